"""STEPQuant plan artifact: round trip, interface, and each defect fails with its message."""

import json

import pytest
import torch

from tests.conftest import MODELS, REPO
from vllm_kvq.artifacts import ArtifactError, OscarArtifact
from vllm_kvq.artifacts.stepquant import StepQuantPlan

FP = {
    "architecture": "Qwen3NextForCausalLM", "num_hidden_layers": 4, "hidden_size": 64,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 100,
    "attention_layers": [2],
}
LAYERS = [0, 1, 3]


def _impact(seed):
    w = torch.rand(4, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1
    return torch.exp(w.log() - w.log().mean(-1, keepdim=True)).float()


def _plan():
    return StepQuantPlan(
        fingerprint=dict(FP), layers=list(LAYERS), num_v_heads=4, k_dim=16, v_dim=32, budgets=[6, 4],
        bits={6: {0: (4, 6, 6, 8), 1: (6, 6, 6, 6), 3: (16, 4, 4, 8)},
              4: {0: (2, 4, 4, 6), 1: (4, 4, 4, 4), 3: (16, 2, 2, 4)}},
        impacts={layer: _impact(layer) for layer in LAYERS},
        log_decay={layer: -torch.rand(4, dtype=torch.float64) for layer in LAYERS},
        omega={layer: torch.rand(4, 16, dtype=torch.float64) for layer in LAYERS},
        distortion={layer: torch.rand(4, 4, dtype=torch.float64) for layer in LAYERS},
        num_k_heads=2, settings={"horizon": 2048}, provenance={"seconds": 1.0},
    )


def test_round_trip_and_interface(tmp_path):
    plan = _plan()
    back = StepQuantPlan.load(plan.save(tmp_path / "p"), FP)
    assert back.layers == LAYERS and back.budgets == [6, 4]
    assert (back.num_v_heads, back.k_dim, back.v_dim) == (4, 16, 32)
    assert back.head_bits(6, 3) == (16, 4, 4, 8) and back.head_bits(4, 0) == (2, 4, 4, 6)
    assert isinstance(back.head_bits(6, 0), tuple)
    w = back.impact(1)
    assert w.dtype == torch.float32 and w.shape == (4, 16) and torch.equal(w, plan.impacts[1])
    assert torch.equal(back.log_decay[0], plan.log_decay[0]) and torch.equal(back.omega[3], plan.omega[3])
    assert back.pivots(6, 3) == [0] and back.pivots(6, 0) == []
    assert back.layout(6, 3).bits == (16, 4, 4, 8)
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert manifest["format"] == "vllm-kvq" and manifest["format_version"] == 2 and manifest["kind"] == "stepquant"
    assert not list((tmp_path / "p").glob("*.pt"))
    with pytest.raises(ArtifactError, match="no plan for budget 5"):
        back.head_bits(5, 0)
    with pytest.raises(ArtifactError, match="layer 2 is not a GDN layer"):
        back.impact(2)


def _write(tmp_path, edit_manifest=None, edit_tensors=None):
    """Write a plan without validating, as a buggy tool would, then apply the edit."""
    from safetensors.torch import save_file

    plan = _plan()
    d = tmp_path / "bad"
    d.mkdir()
    tensors = {f"impact.{i}": plan.impacts[i] for i in LAYERS}
    tensors.update({f"log_decay.{i}": plan.log_decay[i] for i in LAYERS})
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(d / "tensors.safetensors"))
    manifest = {"format": "vllm-kvq", "format_version": 1, "kind": "stepquant", "model_fingerprint": dict(FP),
                "layers": list(LAYERS), "num_v_heads": 4, "k_dim": 16, "v_dim": 32, "budgets": [6, 4],
                "bits": {str(b): {str(k): list(v) for k, v in plan.bits[b].items()} for b in (6, 4)}}
    if edit_manifest:
        edit_manifest(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def _set_bits(budget, layer, widths):
    return lambda m: m["bits"][str(budget)].update({str(layer): widths})


@pytest.mark.parametrize("case,match", [
    ("wrong_model", "different model.*num_hidden_layers"),
    ("wrong_gdn_layers", "covers GDN layers \\[0, 1\\] but the model's are \\[0, 1, 3\\]"),
    ("no_layers", "covers no GDN layers"),
    ("no_budgets", "no budgets"),
    ("width", "widths \\[3\\]; allowed are \\[2, 4, 6, 8, 16\\]"),
    ("count", "has 3 widths, expected 4"),
    ("over_budget", "budget 6 layer 1 spends 26 bits > 6x4 = 24"),
    ("pivot_over_budget", "budget 4 layer 3 spends 18 bits > 4x4 = 16"),
    ("missing_budget", "no widths for budget 4"),
    ("missing_layer_bits", "budget 6 has no widths for layer 3"),
    ("missing_impact", "missing tensor 'impact.1'"),
    ("impact_shape", "impact.0 has shape \\(4, 8\\), expected \\(4, 16\\)"),
    ("impact_nan", "impact.0 contains NaN"),
    ("impact_negative", "impact.3 has non-positive entries"),
    ("impact_scale", "impact.0 is not normalised"),
    ("log_decay_positive", "log_decay.1 has positive entries"),
    ("log_decay_shape", "log_decay.1 has shape \\(5,\\), expected \\(4,\\)"),
    ("version", "unknown format_version 9"),
    ("format", "format 'other' is not 'vllm-kvq'"),
    ("kind", "unknown artifact kind 'mystery'"),
    ("lacks", "manifest lacks \\['k_dim'\\]"),
])
def test_each_defect_is_named(tmp_path, case, match):
    def impact_edit(layer, fn):
        return lambda t: t.update({f"impact.{layer}": fn(t[f"impact.{layer}"])})

    def nan(w):
        w = w.clone()
        w[0, 0] = float("nan")
        return w

    def negative(w):
        w = w.clone()
        w[1, 2] = -w[1, 2]
        return w

    edits = {
        "wrong_model": dict(edit_manifest=lambda m: m["model_fingerprint"].update(num_hidden_layers=5)),
        "wrong_gdn_layers": dict(edit_manifest=lambda m: m.update(layers=[0, 1])),
        "no_layers": dict(edit_manifest=lambda m: m.update(layers=[])),
        "no_budgets": dict(edit_manifest=lambda m: m.update(budgets=[])),
        "width": dict(edit_manifest=_set_bits(6, 0, [3, 6, 6, 6])),
        "count": dict(edit_manifest=_set_bits(6, 0, [6, 6, 6])),
        "over_budget": dict(edit_manifest=_set_bits(6, 1, [8, 6, 6, 6])),
        "pivot_over_budget": dict(edit_manifest=_set_bits(4, 3, [16, 2, 2, 6])),
        "missing_budget": dict(edit_manifest=lambda m: m["bits"].pop("4")),
        "missing_layer_bits": dict(edit_manifest=lambda m: m["bits"]["6"].pop("3")),
        "missing_impact": dict(edit_tensors=lambda t: t.pop("impact.1")),
        "impact_shape": dict(edit_tensors=impact_edit(0, lambda w: w[:, :8].contiguous())),
        "impact_nan": dict(edit_tensors=impact_edit(0, nan)),
        "impact_negative": dict(edit_tensors=impact_edit(3, negative)),
        "impact_scale": dict(edit_tensors=impact_edit(0, lambda w: w * 2)),
        "log_decay_positive": dict(edit_tensors=lambda t: t.update({"log_decay.1": torch.ones(4, dtype=torch.float64)})),
        "log_decay_shape": dict(edit_tensors=lambda t: t.update({"log_decay.1": -torch.ones(5, dtype=torch.float64)})),
        "version": dict(edit_manifest=lambda m: m.update(format_version=9)),
        "format": dict(edit_manifest=lambda m: m.update(format="other")),
        "kind": dict(edit_manifest=lambda m: m.update(kind="mystery")),
        "lacks": dict(edit_manifest=lambda m: m.pop("k_dim")),
    }[case]
    d = _write(tmp_path, **edits)
    with pytest.raises(ArtifactError, match=match):
        StepQuantPlan.load(d, FP)


def test_missing_manifest_names_the_setting(tmp_path):
    with pytest.raises(ArtifactError, match="point kvq.state_artifact at a directory made by .*--stepquant"):
        StepQuantPlan.load(tmp_path)


def test_save_refuses_an_invalid_plan(tmp_path):
    plan = _plan()
    plan.bits[6][0] = (8, 8, 8, 8)
    with pytest.raises(ArtifactError, match="spends 32 bits"):
        plan.save(tmp_path / "p")
    assert not (tmp_path / "p" / "manifest.json").exists()


def test_each_loader_refuses_the_other_kind(tmp_path):
    plan_dir = _plan().save(tmp_path / "plan")
    with pytest.raises(ArtifactError, match="STEPQuant state plan.*pass it as kvq.state_artifact"):
        OscarArtifact.load(plan_dir)
    oscar = REPO / "examples" / "artifacts" / "house-qwen3-oscar"
    with pytest.raises(ArtifactError, match="OSCAR KV-cache artifact.*pass it as kvq.artifact"):
        StepQuantPlan.load(oscar)


def test_committed_house_plan():
    from transformers import AutoConfig

    from vllm_kvq.artifacts import model_fingerprint

    model = MODELS / "house-qwen3next"
    plan = StepQuantPlan.load(REPO / "examples" / "artifacts" / "house-qwen3next-stepquant",
                              model_fingerprint(AutoConfig.from_pretrained(model)))
    assert plan.layers == [0, 1, 2, 4, 5, 6] and plan.budgets == [6, 4]
    assert (plan.num_v_heads, plan.k_dim, plan.v_dim) == (4, 128, 128)
    assert plan.provenance["tokens"] == 16384 and plan.provenance["data"].endswith("code-dev.txt.gz")
    for layer in plan.layers:
        assert set(plan.head_bits(6, layer)) <= {4, 6, 8} and sum(plan.head_bits(6, layer)) <= 24
        assert set(plan.head_bits(4, layer)) <= {2, 4, 6, 8} and sum(plan.head_bits(4, layer)) <= 16


FORK_AFTER_LOAD = """
import os, sys
from vllm_kvq.artifacts.stepquant import StepQuantPlan
StepQuantPlan.load(sys.argv[1])
pid = os.fork()
if pid == 0:
    StepQuantPlan.load(sys.argv[1]).impact(0)
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_loading_leaves_the_process_safe_to_fork():
    """vLLM validates the plan in the parent, then forks the engine core, which loads it again."""
    import subprocess
    import sys

    art = REPO / "examples" / "artifacts" / "house-qwen3next-stepquant"
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_LOAD, str(art)], timeout=120)
    assert done.returncode == 0
