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

import torch

from vllm_kvq.artifacts import ArtifactError, OscarArtifact, StepQuantPlan, builtin_artifact, model_fingerprint
from vllm_kvq.artifacts.fingerprint import gdn_layers, text_config
from vllm_kvq.artifacts.oscar import DEFAULT_SINK, DEFAULT_WINDOW, read_page_fields
from vllm_kvq.backends.schemes import SCHEMES
from vllm_kvq.backends.settings import OscarSettings, SettingsError
from vllm_kvq.kernels.oscar.format import LayerTiers, PagedFormat
from vllm_kvq.kernels.stepquant.format import StateLayout, fp32_state_bytes


@dataclass(frozen=True)
class CachePlan:
    """The pages every layer gets: sink, window and tiers per layer (None: INT2)."""

    sink: int
    window: int
    tiers: dict | None

    def layer_tiers(self, layer: int | None) -> LayerTiers | None:
        return None if self.tiers is None else self.tiers[min(self.tiers) if layer is None else layer]


@functools.lru_cache(maxsize=8)
def cache_plan(settings: OscarSettings) -> CachePlan:
    """Settings over the artifact's manifest (no tensors read: page sizes are
    needed before any layer loads the artifact)."""
    fields = {"sink": DEFAULT_SINK, "window": DEFAULT_WINDOW, "tiers": None}
    if settings.artifact:
        fields = read_page_fields(settings.artifact)
        if fields["tiers"] is not None and not SCHEMES[settings.scheme].takes_tiers:
            raise SettingsError(f"artifact {settings.artifact} stores rows in tiers, which scheme {settings.scheme!r} "
                                "does not take; drop kvq.scheme (the default 'oscar' serves them)")
        if fields["tiers"] is not None and settings.rotation_mode != "artifact":
            raise SettingsError(f"artifact {settings.artifact} stores rows in tiers of its own calibrated directions; "
                                f"drop kvq.rotation {settings.rotation!r} (the tiers need the artifact's rotations)")
        for name in () if settings.override_artifact else ("sink", "window", "k_clip", "v_clip"):
            mine, value = getattr(settings, name), fields[name]
            theirs = set(value.values()) if isinstance(value, dict) else {value}
            if mine is not None and theirs != {mine}:
                shown = sorted(theirs)[0] if len(theirs) == 1 else f"{sorted(theirs)} (per layer)"
                raise SettingsError(
                    f"kvq.{name}={mine} differs from the {shown} that artifact {settings.artifact} was calibrated "
                    f"with; drop kvq.{name} to serve the artifact's, or add \"override_artifact\": true to "
                    "serve it anyway")
    return CachePlan(fields["sink"] if settings.sink is None else settings.sink,
                     fields["window"] if settings.window is None else settings.window, fields["tiers"])


def page_format(head_size: int, block_size: int, settings: OscarSettings, layer: int | None = None) -> PagedFormat:
    """The page format of a layer (None: any layer; every layer has the same
    bytes per token). With speculative decoding the window ring gets a spare
    slot per draft token."""
    plan = cache_plan(settings)
    fmt = SCHEMES[settings.scheme].page_format(head_size, block_size, plan.sink, plan.window,
                                               plan.layer_tiers(layer), settings)
    return dataclasses.replace(fmt, ring_slack=settings.speculative_tokens) if settings.speculative_tokens else fmt


def resolve_artifact(settings: OscarSettings, hf_config) -> OscarArtifact:
    """The validated artifact for this model (ArtifactError naming any
    defect), loaded once per process, with the serving sink, window and clips."""
    return _resolve(settings, json.dumps(model_fingerprint(hf_config), sort_keys=True))


@functools.lru_cache(maxsize=8)
def _resolve(settings: OscarSettings, fingerprint_json: str) -> OscarArtifact:
    fingerprint, plan = json.loads(fingerprint_json), cache_plan(settings)
    loaded = OscarArtifact.load(settings.artifact, fingerprint) if settings.artifact else None
    art = loaded if settings.rotation_mode == "artifact" else builtin_artifact(fingerprint, settings.rotation_mode)
    clips = {name: dict(getattr(loaded or art, name)) for name in ("k_clip", "v_clip")}  # the artifact's, if any
    for name in ("k_clip", "v_clip"):
        if getattr(settings, name) is not None:
            clips[name] = dict.fromkeys(art.layers, getattr(settings, name))
    return dataclasses.replace(art, sink=plan.sink, window=plan.window, **clips)


RECORD_ALIGN = 16  # bytes; the GDN state records (kvq.state) below


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
    tail: int = 0  # updates a record holds between fits (kvq.state_refit_every - 1)

    def local(self, layer: int, tp_size: int, tp_rank: int):
        """This rank's record layout and impacts of a layer."""
        per = self.num_v_heads // tp_size
        heads = slice(tp_rank * per, (tp_rank + 1) * per)
        layout = StateLayout(self.bits[layer][heads], self.k_dim, self.v_dim, self.record_bytes, self.tail)
        return layout, self.impact[layer][heads].contiguous()

    def fp32_bytes(self, tp_size: int) -> int:
        return fp32_state_bytes(self.num_v_heads // tp_size, self.k_dim, self.v_dim)


def pool_plan(settings: OscarSettings, hf_config, tp_size: int) -> PoolPlan | None:
    """The plan for this model, or None when the pool stays native."""
    if settings.state is None:
        return None
    cfg = text_config(hf_config)
    shape = tuple(int(getattr(cfg, n, 0) or 0) for n in
                  ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    return _plan(settings, json.dumps(model_fingerprint(hf_config), sort_keys=True), tuple(gdn_layers(hf_config)),
                 shape, tp_size)


@functools.lru_cache(maxsize=8)
def _plan(settings, fingerprint_json: str, layers: tuple, shape: tuple, tp_size: int) -> PoolPlan:
    hv, k, v = shape
    if not layers or not hv:
        raise ValueError("kvq.state quantizes gated-delta-net states, and this model has no GDN layers "
                         "(Qwen3-Next / Qwen3.5 class models have them); drop kvq.state")
    if hv % tp_size:
        raise ValueError(f"{hv} GDN value heads do not split over tensor_parallel_size {tp_size}")
    if settings.state == "uniform":
        bits = {layer: (settings.state_bits,) * hv for layer in layers}
        impact = {layer: torch.ones(hv, k) for layer in layers}
        fit, source = "rowwise", f"uniform {settings.state_bits}-bit"
    else:
        plan = StepQuantPlan.load(settings.state_artifact, json.loads(fingerprint_json))
        where = f"STEPQuant plan {settings.state_artifact}"
        if (plan.num_v_heads, plan.k_dim, plan.v_dim) != (hv, k, v):
            raise ArtifactError(f"{where} is for {plan.num_v_heads} value heads of {plan.k_dim}x{plan.v_dim}, the "
                                f"model has {hv} of {k}x{v}; calibrate this model with "
                                "`vllm-kvq calibrate --stepquant`")
        if sorted(plan.layers) != sorted(layers):
            raise ArtifactError(f"{where} covers layers {plan.layers}, the model's GDN layers are {list(layers)}")
        if settings.state_bits not in plan.budgets:
            raise ArtifactError(f"{where} has budgets {plan.budgets}, not kvq.state_bits={settings.state_bits}")
        bits = {layer: plan.head_bits(settings.state_bits, layer) for layer in layers}
        impact = {layer: plan.impact(layer) for layer in layers}
        fit, source = "stepquant", f"{settings.state_artifact} @{settings.state_bits}"
    per, tail = hv // tp_size, settings.state_refit_every - 1
    size = max(StateLayout(b[r * per:(r + 1) * per], k, v, tail=tail).packed_bytes
               for b in bits.values() for r in range(tp_size))
    size = -(-size // RECORD_ALIGN) * RECORD_ALIGN
    if tail:
        source += f", refit every {settings.state_refit_every} steps"
    return PoolPlan(bits, impact, fit, k, v, hv, size, source, tail)
