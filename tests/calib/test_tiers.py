"""Tiered calibration: rotations cut into eigen-direction tiers, 0-bit fills,
and one tier plan for every layer chosen under a byte budget."""

import json

import pytest
import torch

from evalkit.data import CODE as DATA
from tests.conftest import MODELS
from vllm_kvq.artifacts import OscarArtifact, hadamard
from vllm_kvq.calib.rotation import eigen_order, spreader, tiered_rotation
from vllm_kvq.cli import main
from vllm_kvq.kernels.oscar.format import LayerTiers, TierPlan

TIERS = "k=48x4,80x2;v=16x4,48x2,64x0"
SINK, SEQ, TOKENS = 64, 256, 512


def _projector(cols: torch.Tensor) -> torch.Tensor:
    cols = cols.double()
    return cols @ cols.T


def test_tiered_rotation_structure():
    torch.manual_seed(0)
    a = torch.randn(3000, 128, dtype=torch.float64) * torch.logspace(0, 2, 128, dtype=torch.float64)
    cov = a.T @ a / 3000
    u_sorted, ev = eigen_order(cov)
    r = tiered_rotation(u_sorted, TierPlan(16, 48, 64), layer=3, head=1).double()
    assert torch.allclose(r.T @ r, torch.eye(128, dtype=torch.float64), atol=1e-5)
    evals, evecs = torch.linalg.eigh(cov)
    u = evecs[:, torch.argsort(evals, descending=True)]
    assert torch.allclose(ev.double(), evals, rtol=1e-5)
    # Power-of-two tier: the Hadamard spreader; 48: the seeded random one; 0-bit: plain eigenvectors.
    assert torch.allclose(r[:, :16], u[:, :16] @ hadamard(16).double(), atol=1e-5)
    assert torch.allclose(r[:, 16:64], u[:, 16:64] @ spreader(48, 1000 * 3 + 10 * 1 + 1), atol=1e-5)
    assert torch.allclose(r[:, 64:].abs(), u[:, 64:].abs(), atol=1e-5)
    m = spreader(48, 7)
    assert torch.allclose(m.T @ m, torch.eye(48, dtype=torch.float64), atol=1e-12)
    assert torch.equal(m, spreader(48, 7)) and not torch.equal(m, spreader(48, 8))


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    """house-qwen3 calibrated with tiers on a short run, plus direct statistics of the same windows."""
    from transformers import AutoTokenizer

    from vllm_kvq.calib.calibrate import calibrate, read_text, token_windows
    from vllm_kvq.calib.capture import StatsCollector, load_model, run_windows

    model = MODELS / "house-qwen3"
    out = calibrate(str(model), str(DATA), str(tmp_path_factory.mktemp("tiers") / "a"), tokens=TOKENS,
                    seq_len=SEQ, sink=SINK, tiers=LayerTiers.parse(TIERS))
    windows = token_windows(AutoTokenizer.from_pretrained(model), read_text(DATA), TOKENS + SEQ, SEQ)[:-1]
    col = StatsCollector(2, 128, SINK)
    col.mode = "hold_out"
    net = load_model(str(model), "cpu", torch.float32, col)
    direct = {}
    for ids in windows:  # the raw q, k, v of each window, summed here, not by the accumulators
        run_windows(net, [ids], "cpu", "direct")
        for layer, st in col.layers.items():
            q, k, v = (st.held_out[x].double() for x in "qkv")
            qg = q.reshape(2, 4 * SEQ, 128)
            d = direct.setdefault(layer, {"cq": 0, "k": 0, "v": 0, "n": 0})
            d["cq"] = d["cq"] + qg.transpose(1, 2) @ qg
            d["k"] = d["k"] + k[:, SINK:].sum(1)
            d["v"] = d["v"] + v[:, SINK:].sum(1)
            d["n"] += SEQ - SINK
    return OscarArtifact.load(out), out, direct


def test_tiered_keys_span_the_top_query_directions(tiered):
    art, _, direct = tiered
    assert set(art.tiers.values()) == {LayerTiers(TierPlan(48, 80), TierPlan(16, 48, 64))}
    assert sorted(direct) == art.layers
    for layer in art.layers:
        for head in range(2):
            r = art.rotation_for("k", layer, [head])[0].double()
            assert torch.allclose(r.T @ r, torch.eye(128, dtype=torch.float64), atol=1e-5)
            assert torch.allclose(art.rotation_for("v", layer, [head])[0].double().T
                                  @ art.rotation_for("v", layer, [head])[0].double(),
                                  torch.eye(128, dtype=torch.float64), atol=1e-5)
            evals, evecs = torch.linalg.eigh(direct[layer]["cq"][head])
            u = evecs[:, torch.argsort(evals, descending=True)]
            err = (_projector(r[:, :48]) - _projector(u[:, :48])).abs().max().item()
            assert err < 1e-3, (layer, head, err)
            # The stored spectrum is C_Q's (normalisation aside).
            ev = art.eigenvalues["k"][layer][head].double()
            assert torch.allclose(ev / ev.sum(), evals / evals.sum(), atol=1e-6)


def test_fills_are_mean_rows_in_rotated_coordinates(tiered):
    art, _, direct = tiered
    assert art.fill_for("k", art.layers[0], [0, 1]) is None  # keys have no 0-bit tier
    for layer in art.layers:
        fill = art.fill_for("v", layer, [0, 1])
        assert fill.shape == (2, 64) and fill.dtype == torch.float32
        mean = direct[layer]["v"] / direct[layer]["n"]  # [H, D]
        for head in range(2):
            r = art.rotation_for("v", layer, [head])[0].double()
            want = mean[head] @ r[:, 64:]
            assert torch.allclose(fill[head].double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
        assert torch.equal(art.fill_for("v", layer, [1])[0], fill[1])


def test_manifest_and_inspect_show_tiers(tiered, capsys):
    _, out, _ = tiered
    m = json.loads((out / "manifest.json").read_text())
    assert m["tiers"] == {str(i): {"k": [[48, 4], [80, 2]], "v": [[16, 4], [48, 2], [64, 0]]} for i in range(6)}
    assert m["granularity"] == "kv_head" and m["sink"] == SINK
    from safetensors import safe_open

    with safe_open(str(out / "tensors.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {f"v_fill.{i}" for i in range(6)} <= keys and not any(k.startswith("k_fill") for k in keys)
    main(["inspect", str(out), "--model", str(MODELS / "house-qwen3")])
    shown = capsys.readouterr().out
    assert "rows in tiers, 80 B per token and KV head (2.500 bits per element)" in shown
    assert shown.count("k=48x4,80x2;v=16x4,48x2,64x0") == 6


@pytest.mark.parametrize("extra,match", [
    (["--tiers", "k=48x4,64x2;v=16x4,48x2,64x0"], "k: tier widths sum to 112, not the head size 128; make them add up"),
    (["--tiers", "k=48x3,80x2;v=16x4,48x2,64x0"], "k: tier 48x3 has 3 bits; bits must be 4, 2 or 0"),
    (["--tiers", "k=24x4,104x2;v=16x4,48x2,64x0"], "width 24; widths must be positive multiples of 16"),
    (["--tiers", TIERS, "--granularity", "layer"], "need --granularity kv_head; drop --granularity layer"),
    (["--clip", "fitted"], "drop --clip fitted \\(or pass --tiers int2\\)"),
    (["--bytes-per-token", "81"], "--bytes-per-token 81: no tier plan takes exactly that many bytes"),
    (["--tiers", TIERS, "--bytes-per-token", "80"], "give one of them"),
])
def test_bad_tiers_fail_with_the_fix(tmp_path, extra, match, capsys):
    import re

    with pytest.raises(SystemExit) as stop:
        main(["calibrate", str(MODELS / "house-qwen3"), "--data", str(DATA), "--out", str(tmp_path / "a"), *extra])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and re.search(match, err), err
    assert not (tmp_path / "a").exists()


def _synthetic_layer(gen, sharpness: float, t: int = 256, d: int = 64):
    """One KV head's statistics and held-out window: keys and values with
    unequal spread over directions, queries ``sharpness`` times the keys' scale
    (a sharper softmax: key errors move it more)."""
    from vllm_kvq.calib.capture import LayerStats

    spread = torch.logspace(0, 1, d, dtype=torch.float64)
    q = torch.randn(2, t, d, generator=gen, dtype=torch.float64) * spread * sharpness
    k = torch.randn(1, t, d, generator=gen, dtype=torch.float64) * spread
    v = torch.randn(1, t, d, generator=gen, dtype=torch.float64) * spread
    qg = q.reshape(1, 2 * t, d)
    st = LayerStats(cq=qg.transpose(1, 2) @ qg, cs=v.transpose(1, 2) @ v, cv=v.transpose(1, 2) @ v,
                    k_sum=k.sum(1), v_sum=v.sum(1), n_q=2 * t, n_mean=t)
    st.held_out = {"q": q.float(), "k": k.float(), "v": v.float(), "scale": d ** -0.5}
    return st


def test_search_gives_the_keys_that_hurt_more_int4():
    """The same keys and values at one byte budget: where sharper queries
    make the keys' error dominate, the keys get more INT4 directions (and the
    values fewer bytes). The plan takes exactly the budget, and the predicted
    error is what it costs on the held-out window."""
    from vllm_kvq.calib.tier_search import LayerProbe, search

    def probe(sharpness):  # one layer, index 1 (its spreaders' seed)
        return {1: LayerProbe(_synthetic_layer(torch.Generator().manual_seed(0), sharpness), 1, "exact", 4, 16)}

    dull, sharp = probe(0.05), probe(2.0)
    (dull_tiers, _), (sharp_tiers, report) = search(dull, 64, 56, 1.0, 1.0), search(sharp, 64, 56, 1.0, 1.0)
    assert dull_tiers[1].bytes_per_token == sharp_tiers[1].bytes_per_token == 56
    assert sharp_tiers[1].k.int4 > dull_tiers[1].k.int4 and sharp_tiers[1].k.row_bytes > dull_tiers[1].k.row_bytes
    t = sharp_tiers[1]
    ek, ev = sharp[1].error("k", t.k, 1.0), sharp[1].error("v", t.v, 1.0)
    assert report["predicted_kl"] == report["layers"]["1"]["predicted_kl"] == pytest.approx(ek * ek + ev * ev,
                                                                                               rel=1e-4)
    # a sensitivity weighs one kind's error: values that cost 1000x more take the bytes from the keys
    weighted, _ = search(sharp, 64, 56, 1.0, 1.0, {1: {"k": 1.0, "v": 1000.0}})
    assert weighted[1].v.row_bytes > t.v.row_bytes and weighted[1].bytes_per_token == 56


def test_search_takes_one_plan_with_the_least_summed_cost():
    """Every layer gets the same plan: of all pairs of K and V plans that take
    exactly the budget (enumerated here, with their bytes counted here), the
    one with the least ``a_K err_K^2 + a_V err_V^2`` summed over layers,
    which here is no layer's own best. Keys store every direction."""
    from vllm_kvq.calib.tier_search import LayerProbe, search

    d, budget = 64, 56
    layers = {i: _synthetic_layer(torch.Generator().manual_seed(i), sharpness, d=d)
              for i, sharpness in enumerate((2.0, 0.05, 0.5))}
    probes = {i: LayerProbe(st, i, "exact", 4, 16) for i, st in layers.items()}
    weight = {0: {"k": 2.0, "v": 0.2}, 1: {"k": 0.1, "v": 10.0}, 2: {"k": 0.3, "v": 0.3}}
    widths = range(0, d + 1, 16)
    plans = [TierPlan(i4, i2, d - i4 - i2) for i4 in widths for i2 in widths if 0 < i4 + i2 <= d]
    size = lambda p: p.int4 // 2 + p.int2 // 4 + 4 * ((p.int4 > 0) + (p.int2 > 0))  # noqa: E731  codes + fp16 pairs
    pairs = [(pk, pv) for pk in plans for pv in plans if size(pk) + size(pv) == budget and not pk.zero]
    err = {(i, kind, p): probe.error(kind, p, 1.0) for i, probe in probes.items() for kind in "kv" for p in plans}

    def cost(pair, among):
        return sum(weight[i][kind] * err[i, kind, p] ** 2 for i in among for kind, p in zip("kv", pair))

    ranked = sorted(pairs, key=lambda pair: cost(pair, probes))
    assert len(pairs) == 12 and cost(ranked[1], probes) > 1.01 * cost(ranked[0], probes)
    own = {min(pairs, key=lambda pair: cost(pair, [i])) for i in probes}
    assert ranked[0] not in own  # every layer alone would choose another plan

    chosen, report = search(probes, d, budget, 1.0, 1.0, weight)
    best = LayerTiers(*ranked[0])
    assert chosen == {i: best for i in probes}
    assert report["tiers"] == str(best)
    assert report["predicted_kl"] == pytest.approx(cost(ranked[0], probes), rel=1e-4)
    for i in probes:
        assert report["layers"][str(i)]["predicted_kl"] == pytest.approx(cost(ranked[0], [i]), rel=1e-4)


def test_calibrate_searches_the_tiers_by_default(tmp_path, capsys):
    """`vllm-kvq calibrate` without --tiers: one plan for every layer at 80 B
    per token (the default), a valid artifact, and inspect shows it with each
    layer's errors and sensitivities (the held-out window must reach past
    sink + window, hence the short window here)."""
    main(["calibrate", str(MODELS / "house-qwen3"), "--data", str(DATA), "--out", str(tmp_path / "a"),
          "--tokens", "256", "--seq-len", "128", "--sink", "16", "--window", "32"])
    shown = capsys.readouterr().out
    art = OscarArtifact.load(tmp_path / "a")
    assert art.bytes_per_token == 80 and sorted(art.tiers) == art.layers
    report = art.provenance["tier_search"]
    assert report["bytes_per_token"] == 80 and {str(t) for t in art.tiers.values()} == {report["tiers"]}
    assert f"{report['tiers']} for every layer, predicted KL {report['predicted_kl']:.1e}" in shown
    rows = [report["layers"][str(layer)] for layer in art.layers]
    assert report["predicted_kl"] == pytest.approx(sum(row["predicted_kl"] for row in rows), rel=1e-5)
    for row in rows:
        assert row["predicted_kl"] > 0 and row["k_sensitivity"] > 0 and row["v_sensitivity"] > 0
        assert f"KL {row['predicted_kl']:.1e}" in shown
