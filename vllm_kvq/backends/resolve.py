"""From settings plus the served model to what every layer uses: the page
format, the OSCAR artifact and the GDN state plan.

An artifact fixes what it was calibrated with: its sink, window, clip ratios
and tiers are the defaults, and an explicit setting that differs fails at
start unless ``kvq.override_artifact`` says it is meant.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from vllm_kvq.artifacts import ArtifactError, OscarArtifact, builtin_artifact, model_fingerprint
from vllm_kvq.artifacts.fingerprint import gdn_layers, text_config
from vllm_kvq.artifacts.oscar import DEFAULT_SINK, DEFAULT_WINDOW, read_page_fields
from vllm_kvq.backends.schemes import SCHEMES
from vllm_kvq.backends.settings import OscarSettings, SettingsError
from vllm_kvq.kernels.oscar.format import LayerTiers, PagedFormat
from vllm_kvq.kernels.stepquant.format import StateLayout


@dataclass(frozen=True)
class CachePlan:
    """The pages every layer gets: sink, window, clip ratios (None: the
    artifact's per layer, or 1.0 without one) and tiers per layer (None: INT2)."""

    sink: int
    window: int
    k_clip: float | None
    v_clip: float | None
    tiers: dict | None

    def layer_tiers(self, layer: int | None, head_size: int) -> LayerTiers | None:
        if self.tiers is None:
            return None
        return self.tiers[min(self.tiers) if layer is None else layer]


@functools.lru_cache(maxsize=8)
def cache_plan(settings: OscarSettings) -> CachePlan:
    """Settings over the artifact's manifest (no tensors read: page sizes are
    needed before any layer loads the artifact)."""
    if not settings.artifact:
        return CachePlan(DEFAULT_SINK if settings.sink is None else settings.sink,
                         DEFAULT_WINDOW if settings.window is None else settings.window,
                         settings.k_clip, settings.v_clip, None)
    fields = read_page_fields(settings.artifact)
    scheme = SCHEMES[settings.scheme]
    if fields.tiers is not None and not scheme.takes_tiers:
        raise SettingsError(f"artifact {settings.artifact} stores rows in tiers, which scheme {settings.scheme!r} "
                            "does not take; drop kvq.scheme (the default 'oscar' serves them)")
    if fields.tiers is not None and settings.rotation_mode != "artifact":
        raise SettingsError(f"artifact {settings.artifact} stores rows in tiers of its own calibrated directions; "
                            f"drop kvq.rotation {settings.rotation!r} (the tiers need the artifact's rotations)")
    calibrated = {"sink": fields.sink, "window": fields.window, "k_clip": fields.k_clip, "v_clip": fields.v_clip}
    if not settings.override_artifact:
        for name, value in calibrated.items():
            mine = getattr(settings, name)
            if mine is None:
                continue
            theirs = set(value.values()) if isinstance(value, dict) else {value}
            if theirs != {mine}:
                shown = sorted(theirs)[0] if len(theirs) == 1 else f"{sorted(theirs)} (per layer)"
                raise SettingsError(
                    f"kvq.{name}={mine} differs from the {shown} that artifact {settings.artifact} was calibrated "
                    f"with; drop kvq.{name} to serve the artifact's, or add \"override_artifact\": true to "
                    "serve it anyway")
    return CachePlan(fields.sink if settings.sink is None else settings.sink,
                     fields.window if settings.window is None else settings.window,
                     settings.k_clip, settings.v_clip, fields.tiers)


def page_format(head_size: int, block_size: int, settings: OscarSettings, layer: int | None = None) -> PagedFormat:
    """The page format of a layer (None: any layer; every layer has the same
    bytes per token)."""
    plan = cache_plan(settings)
    return SCHEMES[settings.scheme].page_format(head_size, block_size, plan.sink, plan.window,
                                                plan.layer_tiers(layer, head_size), settings)


def resolve_artifact(settings: OscarSettings, hf_config) -> OscarArtifact:
    """The validated artifact for this model, loaded once per process, with
    the serving clip ratios.

    Raises ArtifactError naming the defect: wrong model, missing layers, wrong
    shapes, non-orthogonal or NaN matrices, unknown version.
    """
    fingerprint = json.dumps(model_fingerprint(hf_config), sort_keys=True)
    return _resolve(settings, fingerprint)


@functools.lru_cache(maxsize=8)
def _resolve(settings: OscarSettings, fingerprint_json: str) -> OscarArtifact:
    fingerprint = json.loads(fingerprint_json)
    plan = cache_plan(settings)
    loaded = OscarArtifact.load(settings.artifact, fingerprint) if settings.artifact else None
    if settings.rotation_mode == "artifact":
        art = loaded
    else:
        art = builtin_artifact(fingerprint, settings.rotation_mode)
        if loaded is not None:
            art.k_clip, art.v_clip = dict(loaded.k_clip), dict(loaded.v_clip)
    changes = {"sink": plan.sink, "window": plan.window}
    if plan.k_clip is not None:
        changes["k_clip"] = {i: plan.k_clip for i in art.layers}
    if plan.v_clip is not None:
        changes["v_clip"] = {i: plan.v_clip for i in art.layers}
    return dataclasses.replace(art, **changes)


# ---------------------------------------------------------------------------
# The GDN state plan (kvq.state)
# ---------------------------------------------------------------------------

RECORD_ALIGN = 16


@dataclass(frozen=True)
class PoolPlan:
    """Widths and impacts of every GDN layer (all heads, before TP), and the
    one record size every layer and rank declares."""

    bits: dict  # layer -> tuple of widths, len HV
    impact: dict  # layer -> [HV, K] float32 (ones for the uniform pool)
    fit: str
    k_dim: int
    v_dim: int
    num_v_heads: int
    record_bytes: int
    source: str

    def local(self, layer: int, tp_size: int, tp_rank: int):
        """This rank's record layout and impacts of a layer."""
        per = self.num_v_heads // tp_size
        heads = slice(tp_rank * per, (tp_rank + 1) * per)
        layout = StateLayout(self.bits[layer][heads], self.k_dim, self.v_dim, self.record_bytes)
        return layout, self.impact[layer][heads].contiguous()

    def fp32_bytes(self, tp_size: int) -> int:
        return 4 * (self.num_v_heads // tp_size) * self.k_dim * self.v_dim


def pool_plan(settings: OscarSettings, hf_config, tp_size: int) -> PoolPlan | None:
    """The plan for this model, or None when the pool stays native."""
    if settings.state is None:
        return None
    fingerprint = json.dumps(model_fingerprint(hf_config), sort_keys=True)
    cfg = text_config(hf_config)
    shape = tuple(int(getattr(cfg, n, 0) or 0) for n in
                  ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    return _plan(settings, fingerprint, tuple(gdn_layers(hf_config)), shape, tp_size)


@functools.lru_cache(maxsize=8)
def _plan(settings, fingerprint_json: str, layers: tuple, shape: tuple, tp_size: int) -> PoolPlan:
    import torch

    hv, k, v = shape
    if not layers or not hv:
        raise ValueError(
            "kvq.state quantizes gated-delta-net states, and this model has no GDN layers "
            "(Qwen3-Next / Qwen3.5 class models have them); drop kvq.state"
        )
    if hv % tp_size:
        raise ValueError(f"{hv} GDN value heads do not split over tensor_parallel_size {tp_size}")
    if settings.state == "uniform":
        bits = {layer: (settings.state_bits,) * hv for layer in layers}
        impact = {layer: torch.ones(hv, k) for layer in layers}
        fit, source = "rowwise", f"uniform {settings.state_bits}-bit"
    else:
        from vllm_kvq.artifacts.stepquant import StepQuantPlan

        plan = StepQuantPlan.load(settings.state_artifact, json.loads(fingerprint_json))
        where = f"STEPQuant plan {settings.state_artifact}"
        if (plan.num_v_heads, plan.k_dim, plan.v_dim) != (hv, k, v):
            raise ArtifactError(
                f"{where} is for {plan.num_v_heads} value heads of {plan.k_dim}x{plan.v_dim}, the model "
                f"has {hv} of {k}x{v}; calibrate this model with `vllm-kvq calibrate --stepquant`"
            )
        if sorted(plan.layers) != sorted(layers):
            raise ArtifactError(f"{where} covers layers {plan.layers}, the model's GDN layers are {list(layers)}")
        if settings.state_bits not in plan.budgets:
            raise ArtifactError(f"{where} has budgets {plan.budgets}, not kvq.state_bits={settings.state_bits}")
        bits = {layer: tuple(int(b) for b in plan.head_bits(settings.state_bits, layer)) for layer in layers}
        impact = {layer: plan.impact(layer).float() for layer in layers}
        fit, source = "stepquant", f"{settings.state_artifact} @{settings.state_bits}"
    per = hv // tp_size
    size = max(StateLayout(b[r * per:(r + 1) * per], k, v).packed_bytes
               for b in bits.values() for r in range(tp_size))
    size = -(-size // RECORD_ALIGN) * RECORD_ALIGN
    return PoolPlan(bits, impact, fit, k, v, hv, size, source)
