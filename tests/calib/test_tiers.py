"""Tiered calibration (--tiers): rotations cut into eigen-direction tiers, 0-bit fills."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import MODELS, REPO
from vllm_kvq.artifacts import OscarArtifact, hadamard
from vllm_kvq.artifacts.schema import ArtifactError, check_tiers, parse_tiers
from vllm_kvq.calib.rotation import spreader, tiered_rotation

TIERS = "k=48x4,80x2;v=16x4,48x2,64x0"
DATA = REPO.parent / "shared" / "eval" / "code-dev.txt.gz"
SINK, SEQ, TOKENS = 64, 256, 512


def _projector(cols: torch.Tensor) -> torch.Tensor:
    cols = cols.double()
    return cols @ cols.T


def test_parse_tiers():
    assert parse_tiers(TIERS) == {"k": [(48, 4), (80, 2)], "v": [(16, 4), (48, 2), (64, 0)]}
    check_tiers(parse_tiers(TIERS), 128)
    for bad, match in [("k=48x4,80x2", "exactly the kinds 'k' and 'v'"), ("k=48:4;v=128x2", "write WIDTHxBITS"),
                       ("k=128x2;k=128x2", "given twice")]:
        with pytest.raises(ArtifactError, match=match):
            check_tiers(parse_tiers(bad), 128)


def test_tiered_rotation_structure():
    torch.manual_seed(0)
    a = torch.randn(3000, 128, dtype=torch.float64) * torch.logspace(0, 2, 128, dtype=torch.float64)
    cov = a.T @ a / 3000
    tiers = [(16, 4), (48, 2), (64, 0)]
    r, ev = tiered_rotation(cov, tiers, layer=3, head=1)
    r = r.double()
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
                    seq_len=SEQ, sink=SINK, tiers=parse_tiers(TIERS))
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
    assert art.tiers == {"k": [(48, 4), (80, 2)], "v": [(16, 4), (48, 2), (64, 0)]}
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


def test_manifest_and_inspect_show_tiers(tiered):
    _, out, _ = tiered
    m = json.loads((out / "manifest.json").read_text())
    assert m["tiers"] == {"k": [[48, 4], [80, 2]], "v": [[16, 4], [48, 2], [64, 0]]}
    assert m["granularity"] == "kv_head" and m["sink"] == SINK
    from safetensors import safe_open

    with safe_open(str(out / "tensors.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {f"v_fill.{i}" for i in range(6)} <= keys and not any(k.startswith("k_fill") for k in keys)
    ok = subprocess.run([sys.executable, "-m", "vllm_kvq.cli", "inspect", str(out), "--model",
                         str(MODELS / "house-qwen3")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "tiers: k=48x4,80x2; v=16x4,48x2,64x0 (payload K 2.75 + V 1.25 bits/element" in ok.stdout
    assert "0-bit fills: v_fill [2, 64]" in ok.stdout


@pytest.mark.parametrize("extra,match", [
    (["--tiers", "k=48x4,72x2;v=16x4,48x2,64x0"], "k tier widths sum to 120, not head_dim 128; make the widths add up"),
    (["--tiers", "k=48x3,80x2;v=16x4,48x2,64x0"], "k tier 48x3 has 3 bits; bits must be one of \\[0, 2, 4\\]"),
    (["--tiers", "k=12x4,116x2;v=16x4,48x2,64x0"], "width 12; widths must be positive multiples of 8"),
    (["--tiers", TIERS, "--granularity", "layer"], "--tiers needs --granularity kv_head.*drop --granularity layer"),
    (["--tiers", TIERS, "--clip", "fitted"], "drop --clip fitted with --tiers"),
])
def test_bad_tiers_fail_with_the_fix(tmp_path, extra, match):
    import re

    done = subprocess.run([sys.executable, "-m", "vllm_kvq.cli", "calibrate", str(MODELS / "house-qwen3"),
                           "--data", str(DATA), "--out", str(tmp_path / "a"), *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and re.search(match, done.stderr), done.stderr
    assert not (tmp_path / "a").exists()
