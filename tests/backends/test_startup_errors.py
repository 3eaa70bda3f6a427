"""Bad settings and bad artifacts fail at start, naming the problem."""

import json

import pytest
import torch
from transformers import AutoConfig

from tests.conftest import make_llm, model_path
from vllm_kvq.artifacts import OscarArtifact, model_fingerprint


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


def _broken(src, dst, manifest_edit=None, tensor_edit=None):
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
    return dst


CASES = {
    "wrong model": (dict(manifest_edit=lambda m: m["model_fingerprint"].update(hidden_size=1024)),
                    "different model.*hidden_size"),
    "missing layers": (dict(manifest_edit=lambda m: m.update(layers=[0, 1, 2])), "missing layers \\[3, 4, 5\\]"),
    "wrong shapes": (dict(tensor_edit=lambda t: t.update({"k_rotation.2": _orthogonal(64, 64)})),
                     "k_rotation.2 has shape \\(64, 64\\)"),
    "not orthogonal": (dict(tensor_edit=lambda t: t.update({"v_rotation.0": torch.randn(2, 128, 128)})),
                       "v_rotation.0 is not orthogonal"),
    "NaN": (dict(tensor_edit=lambda t: t["k_rotation.5"].__setitem__((1, 3, 3), float("nan"))),
            "k_rotation.5 contains NaN"),
    "unknown version": (dict(manifest_edit=lambda m: m.update(format_version=7)), "unknown format_version 7"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_artifact_fails_at_start(good_artifact, tmp_path, case):
    edits, message = CASES[case]
    bad = _broken(good_artifact, tmp_path / "bad", **edits)
    with pytest.raises(Exception, match=message):
        make_llm(oscar={"artifact": str(bad)})


@pytest.mark.parametrize("kvq,message", [
    ({"rotaton": "none"}, "unknown key\\(s\\) \\['rotaton'\\]"),
    ({"rotation": "learned"}, "kvq.rotation must be one of"),
    ({"rotation": "artifact"}, "needs kvq.artifact"),
    ({"group_size": 48}, "group_size 48"),
    ({"k_clip": 1.5}, "kvq.k_clip must be in"),
    ({"scheme": "kivl"}, "kvq.scheme must be one of"),
    ({"scheme": "kivi", "key_group": 48}, "kvq.key_group"),
    ({"key_group": 64}, "apply to scheme 'kivi' only"),
    ({"scheme": "kivi", "key_pairs": "int4"}, "kvq.key_pairs must be"),
    ({"scheme": "kivi", "k_clip": 0.9}, "drop kvq.k_clip"),
    ({"scheme": "kivi", "window": 16}, "kvq.window must be >= 32"),
    ({"scheme": "kivi", "kernels": "triton"}, "PyTorch reference ops, not the Triton kernels"),
    ({"group_size": 32, "kernels": "triton"}, "group_size 32: set kvq.group_size to 128 or 64"),
])
def test_bad_settings_fail_at_start(kvq, message):
    with pytest.raises(Exception, match=message):
        make_llm(oscar=kvq)


def test_wrong_cache_dtype_fails_at_start():
    with pytest.raises(Exception, match="--kv-cache-dtype auto"):
        make_llm(oscar={}, kv_cache_dtype="fp8")
