"""Bad settings and bad artifacts fail at start, naming the problem and the
fix: each case builds the engine's config (every start-up check runs) without
starting an engine."""

import json
import shutil

import pytest
import torch
from transformers import AutoConfig

from tests.conftest import REPO, engine_config, model_path
from vllm_kvq.artifacts import OscarArtifact, model_fingerprint

ARTIFACTS = REPO / "examples" / "artifacts"
OSCAR = ARTIFACTS / "house-qwen3-oscar"
TIERED = ARTIFACTS / "house-qwen3-tiered"


def _orthogonal(*shape):
    return torch.linalg.qr(torch.randn(*shape))[0].contiguous()


@pytest.fixture(scope="module")
def good_artifact(tmp_path_factory):
    fp = model_fingerprint(AutoConfig.from_pretrained(model_path()))
    layers = fp["attention_layers"]
    art = OscarArtifact(
        fingerprint=fp, head_dim=128, num_kv_heads=2, layers=layers, granularity="kv_head",
        k_rotation={i: _orthogonal(2, 128, 128) for i in layers},
        v_rotation={i: _orthogonal(2, 128, 128) for i in layers},
        k_clip={i: 0.96 for i in layers}, v_clip={i: 0.92 for i in layers},
    )
    return art.save(tmp_path_factory.mktemp("art") / "good")


def _broken(src, dst, manifest_edit=None, tensor_edit=None, raw=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    manifest = json.loads((src / "manifest.json").read_text())
    tensors = load_file(str(src / "tensors.safetensors"))
    if manifest_edit:
        manifest_edit(manifest)
    if tensor_edit:
        tensor_edit(tensors)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    save_file(tensors, str(dst / "tensors.safetensors"))
    if raw:
        raw(dst)
    return dst


def _truncate(d):
    data = (d / "tensors.safetensors").read_bytes()
    (d / "tensors.safetensors").write_bytes(data[: len(data) // 2])


CASES = {
    "wrong model": (dict(manifest_edit=lambda m: m["model_fingerprint"].update(hidden_size=1024)),
                    "different model.*hidden_size.*calibrate this model with `vllm-kvq calibrate"),
    "missing layers": (dict(manifest_edit=lambda m: m.update(layers=[0, 1, 2])), "missing layers \\[3, 4, 5\\]"),
    "wrong shapes": (dict(tensor_edit=lambda t: t.update({"k_rotation.2": _orthogonal(64, 64)})),
                     "k_rotation.2 has shape \\(64, 64\\)"),
    "not orthogonal": (dict(tensor_edit=lambda t: t.update({"v_rotation.0": torch.randn(2, 128, 128)})),
                       "v_rotation.0 is not orthogonal"),
    "NaN": (dict(tensor_edit=lambda t: t["k_rotation.5"].__setitem__((1, 3, 3), float("nan"))),
            "k_rotation.5 contains NaN"),
    "future version": (dict(manifest_edit=lambda m: m.update(format_version=7)),
                       "unknown format_version 7; this vllm-kvq reads versions \\[1, 2\\]"),
    "unknown field": (dict(manifest_edit=lambda m: m.update(rotation_order="reversed")),
                      "unknown manifest field\\(s\\) \\['rotation_order'\\]"),
    "truncated tensors": (dict(raw=_truncate), "tensors.safetensors cannot be read"),
    "not JSON": (dict(raw=lambda d: (d / "manifest.json").write_text("{oops")), "manifest.json is not valid JSON"),
    "retired groups": (dict(manifest_edit=lambda m: m.update(group_size=64)),
                       "groups of 64, which this release no longer serves"),
    "bad tiers": (dict(manifest_edit=lambda m: m.update(tiers={str(i): {"k": [[48, 4], [64, 2]], "v": [[128, 2]]}
                                                               for i in m["layers"]})),
                  "tier widths sum to 112, not the head size 128"),
    "unequal tiers": (dict(manifest_edit=lambda m: m.update(tiers={str(i): {"k": [[128, 2]], "v": [[64 + 64 * (i == 0), 2]] +
                                                                             ([[64, 0]] if i else [])}
                                                                   for i in m["layers"]}),
                           tensor_edit=lambda t: t.update({f"v_fill.{i}": torch.zeros(2, 64) for i in range(1, 6)})),
                      "different bytes per token"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_artifact_fails_at_start(good_artifact, tmp_path, case):
    edits, message = CASES[case]
    bad = _broken(good_artifact, tmp_path / "bad", **edits)
    with pytest.raises(Exception, match=message):
        engine_config(oscar={"artifact": str(bad)})


def test_missing_artifact_directory(tmp_path):
    with pytest.raises(Exception, match="no manifest.json; point kvq.artifact at a directory made by"):
        engine_config(oscar={"artifact": str(tmp_path / "nowhere")})


def test_other_models_artifact():
    with pytest.raises(Exception, match="calibrated for a different model"):
        engine_config(oscar={"artifact": str(ARTIFACTS / "house-qwen3next-oscar")})


def test_state_plan_passed_as_kv_artifact():
    with pytest.raises(Exception, match="is a STEPQuant state plan.*pass it as kvq.state_artifact"):
        engine_config(oscar={"artifact": str(ARTIFACTS / "house-qwen3next-stepquant")})


def test_fill_with_nan(tmp_path):
    bad = _broken(TIERED, tmp_path / "bad", tensor_edit=lambda t: t["v_fill.3"].__setitem__((0, 1), float("nan")))
    with pytest.raises(Exception, match="v_fill.3 contains NaN"):
        engine_config(oscar={"artifact": str(bad)})


@pytest.mark.parametrize("kvq,message", [
    ({"rotaton": "none"}, "unknown key\\(s\\) \\['rotaton'\\]"),
    ({"rotation": "learned"}, "kvq.rotation must be one of"),
    ({"rotation": "artifact"}, "needs kvq.artifact"),
    ({"group_size": 64}, "kvq.group_size is no longer a setting.*--bytes-per-token"),
    ({"k_clip": 1.5}, "kvq.k_clip must be a number in"),
    ({"v_clip": "high"}, "kvq.v_clip must be a number in"),
    ({"sink": -1}, "kvq.sink must be a non-negative int"),
    ({"window": 2.5}, "kvq.window must be a non-negative int"),
    ({"override_artifact": "yes"}, "kvq.override_artifact must be true or false"),
    ({"scheme": "kivl"}, "kvq.scheme must be one of"),
    ({"scheme": "tiered", "artifact": str(TIERED)}, "served by the default scheme 'oscar'; drop kvq.scheme"),
    ({"scheme": "kivi", "key_group": 48}, "kvq.key_group"),
    ({"key_group": 64}, "does not apply to scheme 'oscar'.*set kvq.scheme 'kivi'"),
    ({"scheme": "kivi", "key_pairs": "int4"}, "kvq.key_pairs must be"),
    ({"scheme": "kivi", "k_clip": 0.9}, "drop kvq.k_clip"),
    ({"scheme": "kivi", "window": 16}, "kvq.window must be >= 32"),
    ({"scheme": "kivi", "kernels": "triton"}, "PyTorch reference ops, not the Triton kernels"),
    ({"scheme": "kivi", "artifact": str(TIERED)}, "stores rows in tiers, which scheme 'kivi' does not take"),
    ({"artifact": str(TIERED), "rotation": "hadamard"}, "drop kvq.rotation 'hadamard'"),
    ({"kernels": "cuda"}, "kvq.kernels must be one of"),
])
def test_bad_settings_fail_at_start(kvq, message):
    with pytest.raises(Exception, match=message):
        engine_config(oscar=kvq)


@pytest.mark.parametrize("kvq,message", [
    ({"sink": 16}, "kvq.sink=16 differs from the 64 that artifact .* was calibrated with"),
    ({"window": 512}, "kvq.window=512 differs from the 256"),
    ({"k_clip": 0.9}, "kvq.k_clip=0.9 differs from the 0.96"),
    ({"v_clip": 1.0}, "kvq.v_clip=1.0 differs from the 0.92"),
])
def test_serving_honours_what_calibration_fixed(kvq, message):
    """The artifact's sink, window and clip ratios are the defaults; another
    explicit value fails at start naming both and the override."""
    with pytest.raises(Exception, match=message + ".*\"override_artifact\": true"):
        engine_config(oscar={"artifact": str(OSCAR), **kvq})
    cfg = engine_config(oscar={"artifact": str(OSCAR), "override_artifact": True, **kvq})
    assert cfg.additional_config["kvq"]["override_artifact"] is True


def test_artifact_values_are_the_defaults(tmp_path):
    """An artifact calibrated with sink 16 and window 32 is served with them
    (the page format vLLM sizes from says so), and restating them is fine."""
    from vllm_kvq.backends.resolve import page_format
    from vllm_kvq.backends.settings import OscarSettings

    art = _broken(OSCAR, tmp_path / "short", manifest_edit=lambda m: m.update(sink=16, window=32))
    engine_config(oscar={"artifact": str(art), "sink": 16})
    fmt = page_format(128, 128, OscarSettings.from_dict({"artifact": str(art)}))
    assert (fmt.sink, fmt.window, fmt.state_blocks) == (16, 32, 3)  # 48 BF16 rows, 18 a block


def test_wrong_cache_dtype_fails_at_start():
    with pytest.raises(Exception, match="--kv-cache-dtype auto"):
        engine_config(oscar={}, kv_cache_dtype="fp8")


def test_mla_model_is_refused(tmp_path):
    """A DeepSeek-V2-style (MLA) config: refused by OSCAR, naming the flag to drop."""
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None,
                           qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1)
    cfg.save_pretrained(tmp_path)
    shutil.copy(REPO / "examples" / "models" / "house-qwen3" / "tokenizer.json", tmp_path)
    with pytest.raises(Exception, match="OSCAR does not support MLA models; drop --attention-backend OSCAR"):
        engine_config(model=str(tmp_path), oscar={}, skip_tokenizer_init=True)


def test_state_pool_needs_a_gdn_model():
    with pytest.raises(Exception, match="no GDN layers"):
        engine_config(additional_config={"kvq": {"state": "uniform"}})


@pytest.mark.parametrize("kvq, message", [
    ({"state": "stepquant"}, "needs kvq.state_artifact"),
    ({"state": "uniform", "state_bits": 5}, "state_bits must be one of"),
    ({"state": "int6"}, "kvq.state must be one of"),
    ({"state_artifact": "/nowhere"}, "kvq.state is not"),
    ({"state": "uniform", "state_refit_every": 0}, "state_refit_every must be an integer from 1 to 8"),
    ({"state_refit_every": 4}, "state_refit_every is set but kvq.state is not"),
])
def test_bad_state_settings_fail_at_start(kvq, message):
    with pytest.raises(Exception, match=message):
        engine_config("house-qwen3next", dtype="bfloat16", additional_config={"kvq": kvq})


@pytest.mark.parametrize("mode, kvq, message", [
    ("NONE", {}, None),
    ("FULL_DECODE_ONLY", {}, None),
    ("FULL_AND_PIECEWISE", {}, "cudagraph_mode FULL_AND_PIECEWISE.*FULL_DECODE_ONLY.*--enforce-eager"),
    ("PIECEWISE", {}, "cudagraph_mode PIECEWISE.*FULL_DECODE_ONLY"),
    ("FULL", {}, "cudagraph_mode FULL\\).*FULL_DECODE_ONLY"),
    ("FULL_DECODE_ONLY", {"kernels": "reference"}, "'reference' stages them.*--enforce-eager"),
    ("FULL_DECODE_ONLY", {"k_dim": 96}, "power-of-two K.*--enforce-eager"),
])
def test_cuda_graph_modes_the_state_pool_takes(mode, kvq, message):
    """On CUDA, full graphs may capture decode-only batches (the Triton step)
    and nothing that stages states: the decision at start, for every mode."""
    import dataclasses
    import types

    from transformers import AutoConfig
    from vllm.config import CompilationConfig, CUDAGraphMode

    from vllm_kvq.backends import settings as kvq_settings
    from vllm_kvq.backends.resolve import pool_plan
    from vllm_kvq.backends.startup import _check_state_graphs

    k_dim = kvq.pop("k_dim", None)
    s = kvq_settings.OscarSettings.from_dict({"state": "uniform", **kvq})
    plan = pool_plan(s, AutoConfig.from_pretrained(model_path("house-qwen3next")), 1)
    if k_dim:
        plan = dataclasses.replace(plan, k_dim=k_dim)
    config = types.SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode[mode]))
    if message is None:
        _check_state_graphs(config, s, plan)
    else:
        with pytest.raises(ValueError, match=message):
            _check_state_graphs(config, s, plan)


def test_bad_input_table_names_real_tests():
    """docs/configuration.md's table of bad inputs points at tests that exist
    (function, and the parametrized case where it names one)."""
    import re

    section = (REPO / "docs" / "configuration.md").read_text().split("## Bad input")[1].split("\n## ")[0]
    refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([^\]]+)\])?`", section)
    assert len(refs) >= 25
    for path, name, case in refs:
        source = (REPO / path).read_text()
        assert f"def {name}(" in source, f"{path}::{name}"
        assert not case or f'"{case}"' in source, f"{path}::{name}[{case}]"
