"""The OSCAR artifact: round trip, and each defect fails with its message."""

import json

import pytest
import torch

from vllm_kvq.artifacts import ArtifactError, OscarArtifact, builtin_artifact, hadamard
from vllm_kvq.kernels.oscar.format import LayerTiers

D = 32
FP = {
    "architecture": "Qwen3ForCausalLM", "num_hidden_layers": 2, "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": D, "vocab_size": 100,
    "attention_layers": [0, 1],
}


def _random_orthogonal(*shape):
    q, _ = torch.linalg.qr(torch.randn(*shape))
    return q


def _artifact(granularity="kv_head"):
    shape = (2, D, D) if granularity == "kv_head" else (D, D)
    return OscarArtifact(
        fingerprint=dict(FP), head_dim=D, num_kv_heads=2, layers=[0, 1], granularity=granularity,
        k_rotation={i: _random_orthogonal(*shape) for i in (0, 1)},
        v_rotation={i: _random_orthogonal(*shape) for i in (0, 1)},
        k_clip={0: 0.96, 1: 0.9}, v_clip={0: 0.92, 1: 1.0},
    )


def test_round_trip(tmp_path):
    art = _artifact()
    art.save(tmp_path / "a")
    back = OscarArtifact.load(tmp_path / "a", FP)
    assert back.layers == [0, 1] and back.k_clip == {0: 0.96, 1: 0.9}
    assert torch.equal(back.k_rotation[1], art.k_rotation[1].float())
    assert back.rotation_for("v", 0, [1]).shape == (1, D, D)
    assert not list(tmp_path.glob("a/*.pt")) and not list(tmp_path.glob("a/*.bin"))


def test_hadamard_is_orthonormal():
    h = hadamard(128)
    assert torch.allclose(h @ h.T, torch.eye(128), atol=1e-6)
    assert builtin_artifact(FP, "hadamard").granularity == "layer"


def _save_and_edit(tmp_path, edit_manifest=None, edit_tensors=None):
    art = _artifact()
    if edit_tensors:
        edit_tensors(art)
    d = tmp_path / "bad"
    # Write without validating, as a buggy tool would.
    from safetensors.torch import save_file

    d.mkdir()
    tensors = {f"{k}_rotation.{i}": getattr(art, f"{k}_rotation")[i].float().contiguous()
               for k in "kv" for i in art.layers if i in getattr(art, f"{k}_rotation")}
    save_file(tensors, str(d / "tensors.safetensors"))
    manifest = {"format": "vllm-kvq", "format_version": 2, "kind": "oscar", "model_fingerprint": dict(FP),
                "head_dim": D, "num_kv_heads": 2, "layers": [0, 1], "granularity": "kv_head",
                "k_clip": {"0": 0.96, "1": 0.96}, "v_clip": {"0": 0.92, "1": 0.92}}
    if edit_manifest:
        edit_manifest(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


@pytest.mark.parametrize("case,match", [
    ("wrong_model", "different model.*num_hidden_layers"),
    ("missing_layer", "missing layers \\[1\\]"),
    ("missing_tensor", "missing tensor 'v_rotation.1'"),
    ("wrong_shape", "has shape \\(2, 8, 8\\), expected \\(2, 32, 32\\)"),
    ("not_orthogonal", "not orthogonal"),
    ("nan", "NaN"),
    ("version", "unknown format_version 99"),
    ("clip", "k_clip\\[0\\] = 1.5"),
    ("kind", "unknown artifact kind 'rotations'"),
    ("field", "unknown manifest field\\(s\\) \\['extra'\\]"),
    ("lacks", "manifest lacks \\['granularity'\\]"),
    ("malformed", "malformed manifest field"),
    ("group", "groups of 16, which this release no longer serves"),
])
def test_each_defect_is_named(tmp_path, case, match):
    edits = {
        "wrong_model": dict(edit_manifest=lambda m: m["model_fingerprint"].update(num_hidden_layers=3)),
        "missing_layer": dict(edit_manifest=lambda m: m.update(layers=[0])),
        "missing_tensor": dict(edit_tensors=lambda a: a.v_rotation.pop(1)),
        "wrong_shape": dict(edit_tensors=lambda a: a.k_rotation.update({0: _random_orthogonal(2, 8, 8)})),
        "not_orthogonal": dict(edit_tensors=lambda a: a.k_rotation.update({0: torch.randn(2, D, D)})),
        "nan": dict(edit_tensors=lambda a: a.v_rotation[0].__setitem__((0, 0, 0), float("nan"))),
        "version": dict(edit_manifest=lambda m: m.update(format_version=99)),
        "clip": dict(edit_manifest=lambda m: m["k_clip"].update({"0": 1.5})),
        "kind": dict(edit_manifest=lambda m: m.update(kind="rotations")),
        "field": dict(edit_manifest=lambda m: m.update(extra=1)),
        "lacks": dict(edit_manifest=lambda m: m.pop("granularity")),
        "malformed": dict(edit_manifest=lambda m: m.update(layers="all")),
        "group": dict(edit_manifest=lambda m: m.update(group_size=16)),
    }[case]
    d = _save_and_edit(tmp_path, **edits)
    with pytest.raises(ArtifactError, match=match):
        OscarArtifact.load(d, FP)


FORK_AFTER_LOAD = """
import os, sys
from vllm_kvq.artifacts import OscarArtifact
OscarArtifact.load(sys.argv[1])
pid = os.fork()
if pid == 0:
    OscarArtifact.load(sys.argv[1])
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_loading_leaves_the_process_safe_to_fork():
    """vLLM validates the artifact in the parent, then forks the engine core,
    which loads it again; torch's OpenMP pool used before a fork hangs the child."""
    import subprocess
    import sys

    from tests.conftest import REPO

    art = REPO / "examples" / "artifacts" / "house-qwen3-oscar"
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_LOAD, str(art)], timeout=120)
    assert done.returncode == 0


TIERS = LayerTiers.parse("k=16x4,16x2;v=16x2,16x0")


def _tiered(granularity="kv_head"):
    art = _artifact(granularity)
    art.tiers = {i: TIERS for i in (0, 1)}
    art.fill = {"v": {i: torch.full((2, 16), 0.5 + i) for i in (0, 1)}}
    return art


def test_tiered_round_trip(tmp_path):
    art = _tiered()
    art.tiers = {0: TIERS, 1: LayerTiers.parse("k=32x4;v=16x2,16x0")}  # layers may differ, at equal bytes
    art.save(tmp_path / "t")
    m = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert m["format_version"] == 2
    assert m["tiers"] == {"0": {"k": [[16, 4], [16, 2]], "v": [[16, 2], [16, 0]]},
                          "1": {"k": [[32, 4]], "v": [[16, 2], [16, 0]]}}
    back = OscarArtifact.load(tmp_path / "t", FP)
    assert back.tiers == art.tiers and back.bytes_per_token == (8 + 4 + 8) + (4 + 4)
    assert back.fill_for("k", 0, [0, 1]) is None
    f = back.fill_for("v", 1, [1])
    assert f.shape == (1, 16) and f.dtype == torch.float32 and torch.equal(f, torch.full((1, 16), 1.5))
    plain = _artifact()
    plain.save(tmp_path / "p")
    assert "tiers" not in json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert OscarArtifact.load(tmp_path / "p").tiers is None and OscarArtifact.load(tmp_path / "p").fill_for(
        "v", 0, [0]) is None


def test_version_1_tiers_serve_every_layer(tmp_path):
    """Version 1 manifests give one plan for all layers."""
    _tiered().save(tmp_path / "t")
    m = json.loads((tmp_path / "t" / "manifest.json").read_text())
    m.update(format_version=1, tiers={"k": [[16, 4], [16, 2]], "v": [[16, 2], [16, 0]]})
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(m))
    assert OscarArtifact.load(tmp_path / "t", FP).tiers == {0: TIERS, 1: TIERS}


@pytest.mark.parametrize("case,match", [
    ("missing_fill", "missing tensor 'v_fill.1', the mean of layer 1's 0-bit v tier; re-run `vllm-kvq calibrate"),
    ("fill_shape", "v_fill.0 has shape \\(2, 4\\), expected \\(2, 16\\)"),
    ("sum", "layer 1 tiers v: tier widths sum to 48, not the head size 32"),
    ("bits", "tier 16x3 has 3 bits; bits must be 4, 2 or 0"),
    ("width", "width 8; widths must be positive multiples of 16"),
    ("kinds", "tiers must be an object with 'k' and 'v'"),
    ("layout", "a tier is a \\[width, bits\\] pair of integers"),
    ("order", "strongest first"),
    ("unequal", "different bytes per token"),
    ("granularity", "tiers need granularity 'kv_head', not 'layer'"),
])
def test_each_tier_defect_is_named(tmp_path, case, match):
    from safetensors import safe_open
    from safetensors.torch import save_file

    art = _tiered("layer" if case == "granularity" else "kv_head")
    tiers = {str(i): TIERS.to_json() for i in (0, 1)}
    if case == "granularity":
        art.tiers = None  # save() validates; the manifest gets its tiers below
    art.save(tmp_path / "a")
    d = tmp_path / "a"
    edit = {
        "sum": lambda t: t["1"].update(v=[[32, 2], [16, 0]]),
        "bits": lambda t: t["0"]["k"].__setitem__(0, [16, 3]),
        "width": lambda t: t["0"].update(k=[[8, 4], [24, 2]]),
        "kinds": lambda t: t["0"].pop("v"),
        "layout": lambda t: t["0"].update(k=[[16, 4, 1]]),
        "order": lambda t: t["0"].update(k=[[16, 2], [16, 4]]),
        "unequal": lambda t: t["1"].update(k=[[32, 2]]),
    }.get(case)
    if edit:
        edit(tiers)
    m = json.loads((d / "manifest.json").read_text())
    m["tiers"] = tiers
    (d / "manifest.json").write_text(json.dumps(m))
    if case in ("missing_fill", "fill_shape", "granularity"):
        with safe_open(str(d / "tensors.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if case == "missing_fill":
            tensors.pop("v_fill.1")
        elif case == "fill_shape":
            tensors["v_fill.0"] = torch.zeros(2, 4)
        else:
            tensors.update({f"v_fill.{i}": torch.zeros(2, 16) for i in (0, 1)})
        save_file(tensors, str(d / "tensors.safetensors"))
    with pytest.raises(ArtifactError, match=match):
        OscarArtifact.load(d, FP)
