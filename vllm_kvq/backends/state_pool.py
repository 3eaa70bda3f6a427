"""The quantized gated-delta-net state pool inside vLLM.

vLLM keeps every GDN layer's recurrent state per request slot as
``[HV, V, K]`` in FP32. With ``kvq.state`` set, the slot's state bytes become
one packed record (``kernels/stepquant/format.py``) and vLLM's page shrinks with
it: the layer declares ``(record_bytes,)`` uint8 instead, and so do the model's
class methods that vLLM sizes hybrid pages from.

Forward (CPU): the active slots' records are decoded into a small dense
scratch, vLLM's own GDN step runs on it (decode: the gated delta update and
the readout from the *unquantized* new state; prefill: the native chunk op),
and the new states are fitted and packed back. Conv states stay native; they
are staged beside the recurrent state so both can use the scratch's indices.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from dataclasses import dataclass

import torch

from vllm_kvq import settings as kvq_settings
from vllm_kvq.artifacts.fingerprint import model_fingerprint, text_config
from vllm_kvq.kernels.stepquant import reference as codec
from vllm_kvq.kernels.stepquant.format import PIVOT, StateLayout

RECORD_ALIGN = 16


def gdn_layers(hf_config) -> list[int]:
    cfg = text_config(hf_config)
    types = getattr(cfg, "layer_types", None) or []
    return [i for i, t in enumerate(types) if t == "linear_attention"]


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

    def local(self, layer: int, tp_size: int, tp_rank: int) -> tuple[StateLayout, torch.Tensor]:
        per = self.num_v_heads // tp_size
        heads = slice(tp_rank * per, (tp_rank + 1) * per)
        layout = StateLayout(self.bits[layer][heads], self.k_dim, self.v_dim, self.record_bytes)
        return layout, self.impact[layer][heads].contiguous()

    def fp32_bytes(self, tp_size: int) -> int:
        return 4 * (self.num_v_heads // tp_size) * self.k_dim * self.v_dim


def pool_plan(settings: kvq_settings.OscarSettings, hf_config, tp_size: int) -> PoolPlan | None:
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
        from vllm_kvq.artifacts import ArtifactError
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


# ---------------------------------------------------------------------------
# Per-layer state
# ---------------------------------------------------------------------------


@dataclass
class LayerPool:
    layout: StateLayout
    impact: torch.Tensor
    fit: str
    native_dtype: torch.dtype  # what vLLM's GDN kernels compute the state in


def layer_pool(layer) -> LayerPool | None:
    """The pool of one vLLM GDN layer, None when its state stays native.

    Resolved once, while the layer is built (vLLM's config and the TP rank are
    known then), and cached on the layer.
    """
    if "_kvq_pool" in layer.__dict__:
        return layer.__dict__["_kvq_pool"]
    s = kvq_settings.current()
    pool = None
    if s.state is not None:
        from vllm.distributed import get_tensor_model_parallel_rank

        plan = pool_plan(s, layer.model_config.hf_config, layer.tp_size)
        layout, impact = plan.local(layer.layer_idx, layer.tp_size, get_tensor_model_parallel_rank())
        pool = LayerPool(layout, impact, plan.fit, layer._kvq_native_dtypes()[1])
    layer.__dict__["_kvq_pool"] = pool
    return pool


def encode_states(states: torch.Tensor, pool: LayerPool) -> torch.Tensor:
    return codec.encode(states.float(), pool.layout, pool.impact.to(states.device), pool.fit)


def decode_states(records: torch.Tensor, pool: LayerPool) -> torch.Tensor:
    return codec.decode(records, pool.layout)


class _StagedLayer:
    """The GDN layer as vLLM's kernels see it, with staged states: attributes
    come from the layer, methods run on this view (so ``self.kv_cache`` inside
    them is the scratch)."""

    def __init__(self, layer, kv_cache):
        self.__dict__["_layer"] = layer
        self.__dict__["kv_cache"] = kv_cache

    def __getattr__(self, name):
        layer = self.__dict__["_layer"]
        for klass in type(layer).__mro__:
            if name in klass.__dict__:
                attr = klass.__dict__[name]
                if isinstance(attr, types.FunctionType):
                    return types.MethodType(attr, self)
                break
        return getattr(layer, name)


def _stage(layer, md, pool: LayerPool):
    """Decode the active slots' records (and copy their conv states) into a
    scratch indexed 1..n; returns the staged layer, the metadata that points
    at the scratch, and the function that packs the new states back."""
    n = md.num_decodes + md.num_prefills
    slots = md.non_spec_state_indices_tensor[:n].to(torch.long)
    conv, records = layer.kv_cache
    k, v = pool.layout.k_dim, pool.layout.v_dim
    heads = len(pool.layout.bits)
    states = torch.zeros(n + 1, heads, k, v, dtype=pool.native_dtype, device=records.device)
    live = slots > 0  # slot 0 is vLLM's null block (padding)
    fresh = torch.zeros_like(live)
    if md.num_prefills:
        fresh[md.num_decodes:] = ~md.has_initial_state[md.num_decodes:n].to(torch.bool)
    read = live & ~fresh
    if bool(read.any()):
        states[1:][read] = decode_states(records[slots[read]], pool).to(pool.native_dtype)
    conv_scratch = torch.zeros((n + 1, *conv.shape[1:]), dtype=conv.dtype, device=conv.device)
    conv_scratch[1:][live] = conv[slots[live]]
    local = torch.arange(1, n + 1, dtype=md.non_spec_state_indices_tensor.dtype, device=slots.device)
    changes = {"non_spec_state_indices_tensor": local}
    if getattr(md, "prefill_state_indices", None) is not None:
        changes["prefill_state_indices"] = local[md.num_decodes:n].to(md.prefill_state_indices.dtype)
    # The CPU kernels view the state bytes as [HV, K, V] (key rows): the
    # scratch is laid out that way and declared as vLLM's [HV, V, K]. The CUDA
    # kernels read [HV, V, K] as it is: the scratch is transposed for them.
    if records.device.type == "cpu":
        scratch = states.view(n + 1, heads, v, k)
    else:
        scratch = states.transpose(-1, -2).contiguous()
    proxy = _StagedLayer(layer, (conv_scratch, scratch))

    def finish():
        new = scratch.view(n + 1, heads, k, v) if records.device.type == "cpu" else scratch.transpose(-1, -2)
        conv[slots[live]] = conv_scratch[1:][live]
        records[slots[live]] = encode_states(new[1:][live], pool)

    return proxy, dataclasses.replace(md, **changes), finish


def staged(run_native):
    """Wrap vLLM's CPU GDN step ``run_native(layer, metadata, mixed_qkv, b,
    a, out)`` so that it reads and writes packed records."""

    @functools.wraps(run_native)
    def run(layer, md, mixed_qkv, b, a, core_attn_out):
        pool = layer_pool(layer)
        if pool is None:
            return run_native(layer, md, mixed_qkv, b, a, core_attn_out)
        proxy, staged_md, finish = _stage(layer, md, pool)
        run_native(proxy, staged_md, mixed_qkv, b, a, core_attn_out)
        finish()

    return run


def staged_forward_core(forward_core):
    """The same for the CUDA path, ``layer._forward_core(mixed_qkv, b, a,
    out)``, which finds its metadata in vLLM's forward context."""

    @functools.wraps(forward_core)
    def run(self, mixed_qkv, b, a, core_attn_out):
        pool = layer_pool(self)
        table = None
        if pool is not None:
            from vllm.forward_context import get_forward_context

            table = get_forward_context().attn_metadata
        md = table.get(self.prefix) if isinstance(table, dict) else None
        if md is None:
            return forward_core(self, mixed_qkv, b, a, core_attn_out)
        proxy, staged_md, finish = _stage(self, md, pool)
        table[self.prefix] = staged_md
        try:
            forward_core(proxy, mixed_qkv, b, a, core_attn_out)
        finally:
            table[self.prefix] = md
        finish()

    return run


def allocated_state_bytes(model) -> list[dict]:
    """Per GDN layer of a loaded vLLM model (for ``LLM.apply_model``): the
    recurrent state's per-slot shape and dtype, the bytes vLLM allocated per
    slot (the whole page: conv state, recurrent state, padding) and, for a
    packed pool, this rank's head widths."""
    out = []
    for module in model.modules():
        if hasattr(module, "_kvq_native_dtypes") and getattr(module, "kv_cache", None):
            conv, ssm = module.kv_cache
            pool = module.__dict__.get("_kvq_pool")
            out.append({"layer": module.layer_idx, "shape": list(ssm.shape[1:]), "dtype": str(ssm.dtype),
                        "page_bytes": conv.stride(0) * conv.element_size(),
                        "bits": list(pool.layout.bits) if pool else None})
    return out
