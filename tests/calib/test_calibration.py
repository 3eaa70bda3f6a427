"""Calibration: rotations, streamed statistics, artifacts, RotationZoo, inspect."""

import pytest
import torch

from evalkit.data import CODE
from tests.conftest import MODELS, REPO, model_path
from vllm_kvq.artifacts import ArtifactError, OscarArtifact, model_fingerprint
from vllm_kvq.calib.calibrate import calibrate
from vllm_kvq.calib.rotation import bit_reversal_permutation, oscar_rotation


def test_bit_reversal_spreads_the_top_directions():
    evals = torch.rand(128)
    order = torch.argsort(evals, descending=True)
    y = torch.arange(128, dtype=torch.float64)
    z = y @ bit_reversal_permutation(evals)
    assert z[0] == order[0] and z[64] == order[1] and z[32] == order[2] and z[96] == order[3]


def test_oscar_rotation_is_orthogonal_and_balances_importance():
    a = torch.randn(4000, 64, dtype=torch.float64) * torch.logspace(0, 2, 64, dtype=torch.float64)
    cov = a.T @ a / 4000
    r, ev = oscar_rotation(cov)
    assert torch.allclose(r.double().T @ r.double(), torch.eye(64, dtype=torch.float64), atol=1e-5)
    metric = torch.diagonal(r.double().T @ cov @ r.double())
    # U·H makes every coordinate equally important: tr(C)/d on the diagonal.
    assert torch.allclose(metric, torch.full_like(metric, cov.trace().item() / 64), rtol=1e-6)
    assert torch.allclose(ev.sort().values, torch.linalg.eigvalsh(cov).float(), rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("tiny") / "model"
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def test_streamed_statistics_match_a_direct_computation(tiny_model):
    from vllm_kvq.calib.capture import StatsCollector, load_model, run_windows

    col = StatsCollector(2, 32)
    net = load_model(str(tiny_model), "cpu", torch.float32, col)
    window = [torch.randint(10, 8000, (96,)).tolist()]
    run_windows(net, window, "cpu", "cov")
    col.mode = "proxy"
    run_windows(net, window, "cpu", "proxy")
    col.mode = "hold_out"
    run_windows(net, window, "cpu", "same window")
    st = col.layers[1]
    q, k, v = (st.held_out[x].double() for x in "qkv")  # [H, T, D]
    qg = q.view(2, 2, 96, 32).reshape(2, 192, 32)
    assert torch.allclose(st.cq, qg.transpose(1, 2) @ qg, rtol=1e-5, atol=1e-6)
    logits = (q.view(2, 2, 96, 32) @ k.unsqueeze(1).transpose(-1, -2)) * st.held_out["scale"]
    mask = torch.ones(96, 96, dtype=torch.bool).tril()
    o = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ v.unsqueeze(1)  # [H, g, T, D]
    o = o.reshape(2, 192, 32)
    assert torch.allclose(st.cs, o.transpose(1, 2) @ o, rtol=1e-4, atol=1e-5)
    c_q = st.cq / st.n_q
    w = torch.einsum("htd,hde,hte->ht", k, c_q, k)
    assert torch.allclose(st.cv, (v * w.unsqueeze(-1)).transpose(1, 2) @ v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("granularity,target,clip", [("kv_head", "proxy", "fixed"), ("layer", "exact", "fitted")])
def test_calibrate_writes_a_valid_int2_artifact(tiny_model, tmp_path, granularity, target, clip):
    from transformers import AutoConfig

    from vllm_kvq.calib.calibrate import INT2, calibrate

    out = calibrate(str(tiny_model), str(CODE), str(tmp_path / "a"),
                    tokens=512, seq_len=256, granularity=granularity, value_target=target, clip=clip,
                    sink=16, window=32, tokenizer=str(MODELS / "house-qwen3"), tiers=INT2)
    art = OscarArtifact.load(out, model_fingerprint(AutoConfig.from_pretrained(tiny_model)))
    shape = (2, 32, 32) if granularity == "kv_head" else (32, 32)
    assert art.k_rotation[0].shape == shape and art.provenance["value_target"] == target
    if clip == "fitted":
        fit = art.provenance["clip_fit"]["0"]
        assert min(fit["k_error"].values()) == fit["k_error"][str(art.k_clip[0])]
    else:
        assert art.k_clip[1] == 0.96 and art.v_clip[1] == 0.92


def _zoo_file(path, version, rotations):
    layers = {str(i): {"layer_id": i, "rotation": r, "eigenvalues": torch.ones(r.shape[-1])}
              for i, r in rotations.items()}
    torch.save({"format_version": version, "objective": "qqt_r_h_pbr", "layers": layers}, path)


@pytest.mark.parametrize("version", [1, 2])
def test_rotation_zoo_import(tmp_path, version):
    from vllm_kvq.calib.zoo import import_zoo

    fp = {"architecture": "Qwen3ForCausalLM", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8192, "attention_layers": [0, 1]}
    shape = (32, 32) if version == 1 else (2, 32, 32)
    rots = {i: torch.linalg.qr(torch.randn(*shape))[0].contiguous() for i in (0, 1)}
    _zoo_file(tmp_path / "k.pt", version, rots)
    _zoo_file(tmp_path / "v.pt", version, rots)
    art = import_zoo(str(tmp_path / "k.pt"), str(tmp_path / "v.pt"), fp, out=str(tmp_path / "art"))
    assert art.granularity == ("layer" if version == 1 else "kv_head")
    assert torch.equal(OscarArtifact.load(tmp_path / "art", fp).v_rotation[1], rots[1])


class _Payload:
    """Unpickling it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_rotation_zoo_refuses_pickled_code(tmp_path):
    from vllm_kvq.calib.zoo import read_zoo

    marker = tmp_path / "payload-ran"
    torch.save({"format_version": 1, "layers": {"0": {"rotation": _Payload(marker)}}}, tmp_path / "evil.pt")
    with pytest.raises(ArtifactError, match="pickled objects, which are never run"):
        read_zoo(str(tmp_path / "evil.pt"))
    assert not marker.exists()


@pytest.mark.parametrize("case,match", [
    ("missing model", "cannot read a model config from .*nowhere.*checkpoint directory"),
    ("missing data", "--data .*absent.txt: no such file"),
    ("empty data", "--data .*empty.txt is empty"),
    ("short windows", "--seq-len 256 must exceed --sink \\+ --window \\(320\\)"),
])
def test_calibrate_refuses_bad_input_before_loading(tmp_path, case, match):
    (tmp_path / "empty.txt").write_text("\n")
    model = str(tmp_path / "nowhere") if case == "missing model" else str(model_path())
    data = {"missing data": "absent.txt", "empty data": "empty.txt"}.get(case, "empty.txt")
    with pytest.raises(ArtifactError, match=match):
        calibrate(model, str(tmp_path / data), str(tmp_path / "out"), seq_len=256 if case == "short windows" else 2048)
    assert not (tmp_path / "out").exists()


def test_inspect_cli(capsys):
    from vllm_kvq.cli import main

    art = REPO / "examples" / "artifacts" / "house-qwen3-oscar"
    main(["inspect", str(art), "--model", str(MODELS / "house-qwen3")])
    shown = capsys.readouterr().out
    assert ": valid" in shown and "kv_head granularity over 6 attention layers" in shown
    with pytest.raises(SystemExit) as stop:
        main(["inspect", str(art), "--model", str(MODELS / "house-qwen2")])
    assert stop.value.code == 1 and "different model" in capsys.readouterr().err


def test_fitted_clip_errors_are_attention_output_errors():
    """Each grid point's error is the relative attention-output error of the
    INT2 cache at that clip (keys first, then values at the chosen key clip)."""
    from tests.backends.oscar_standalone import naive_int2
    from vllm_kvq.calib.fit import CLIP_GRID, fit_clip
    from vllm_kvq.kernels.oscar.reference import mixed_attention

    torch.manual_seed(0)
    h, g, t, d = 2, 2, 96, 32
    held = {"q": torch.randn(h * g, t, d), "k": torch.randn(h, t, d), "v": torch.randn(h, t, d), "scale": 0.2}
    held["k"][..., 3] *= 8
    rk, rv = torch.eye(d), torch.eye(d)
    ck, cv, report = fit_clip(held, rk, rv, 4, 8)
    q = held["q"].transpose(0, 1)
    k, v = (held[n].transpose(0, 1).bfloat16().float() for n in ("k", "v"))
    pos = torch.arange(t)
    exact = mixed_attention(q, pos, k, v, k, v, 4, 8, 0.2)

    def err(kc, vc):
        out = mixed_attention(q, pos, k, v, naive_int2(k, kc), naive_int2(v, vc), 4, 8, 0.2)
        return ((out - exact).norm() / exact.norm()).item()

    for c in CLIP_GRID:
        assert report["k_error"][c] == pytest.approx(err(c, 1.0), rel=1e-5)
        assert report["v_error"][c] == pytest.approx(err(ck, c), rel=1e-5)
    assert report["k_error"][ck] == min(report["k_error"].values())
    assert report["v_error"][cv] == min(report["v_error"].values())
