"""The quantized gated-delta-net state pool inside vLLM.

vLLM keeps every GDN layer's recurrent state per request slot as
``[HV, V, K]`` in FP32. With ``kvq.state`` set, the slot's state bytes become
one packed record (``kernels/stepquant/format.py``) and vLLM's page shrinks with
it: the layer declares ``(record_bytes,)`` uint8 instead, and so do the model's
class methods that vLLM sizes hybrid pages from.

Staged forward (CPU; prefill and mixed batches on CUDA): the active slots'
records are decoded into a small dense scratch, vLLM's own GDN step runs on it
(decode: the gated delta update and the readout from the *unquantized* new
state; prefill: the native chunk op), and the new states are fitted and packed
back. Conv states stay native; they are staged beside the recurrent state so
both can use the scratch's indices.

Decode batches on CUDA (one token per request, no speculation) skip the
staging: vLLM's conv update runs on the native conv state, then the fused
Triton step (``kernels/stepquant/triton_step.py``) updates the records in
place, at the slots of vLLM's state indices, inside vLLM's page (the record's
slot stride is the page size) and writes the layer's output. ``kvq.kernels =
"reference"`` keeps decode staged too.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_kvq.backends import settings as kvq_settings
from vllm_kvq.backends.resolve import pool_plan
from vllm_kvq.kernels.stepquant import reference as codec
from vllm_kvq.kernels.stepquant.format import StateLayout

# ---------------------------------------------------------------------------
# Per-layer state
# ---------------------------------------------------------------------------


@dataclass
class LayerPool:
    layout: StateLayout
    impact: torch.Tensor
    fit: str
    native_dtype: torch.dtype  # what vLLM's GDN kernels compute the state in
    kernels: str = "auto"  # kvq.kernels: "reference" keeps CUDA decode staged
    step_plan: object = None  # the Triton step's tables on the records' device (False: layout unsupported)
    triton_calls: int = 0  # decode batches run through the Triton step from Python (a graph replay adds none)


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
        pool = LayerPool(layout, impact, plan.fit, layer._kvq_native_dtypes()[1], s.kernels)
        where = getattr(getattr(layer, "A_log", None), "device", None)
        if where is not None and where.type == "cuda":
            decode_plan(pool, where)  # now: a CUDA graph capture cannot copy its tables
    layer.__dict__["_kvq_pool"] = pool
    return pool


def encode_states(states: torch.Tensor, pool: LayerPool) -> torch.Tensor:
    return codec.encode(states.float(), pool.layout, pool.impact.to(states.device), pool.fit)


def decode_states(records: torch.Tensor, pool: LayerPool, out: torch.Tensor | None = None) -> torch.Tensor:
    return codec.decode(records, pool.layout, out)


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
    states = torch.empty(n + 1, heads, k, v, dtype=pool.native_dtype, device=records.device)
    live = slots > 0  # slot 0 is vLLM's null block (padding)
    fresh = torch.zeros_like(live)
    if md.num_prefills:
        fresh[md.num_decodes:] = ~md.has_initial_state[md.num_decodes:n].to(torch.bool)
    read = live & ~fresh
    # On CPU (where asking costs no device sync) whole batches skip the masked copies
    cpu = records.device.type == "cpu"
    all_live = cpu and bool(live.all())
    if cpu and states.dtype == torch.float32 and bool(read.all()):  # decode batches: straight into the scratch
        states[0].zero_()
        decode_states(records[slots], pool, out=states[1:])
    else:
        states.zero_()
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
    if cpu:
        scratch = states.view(n + 1, heads, v, k)
    else:
        scratch = states.transpose(-1, -2).contiguous()
    proxy = _StagedLayer(layer, (conv_scratch, scratch))

    def finish():
        new = scratch.view(n + 1, heads, k, v) if cpu else scratch.transpose(-1, -2)
        conv[slots[live]] = conv_scratch[1:][live]
        records[slots[live]] = encode_states(new[1:] if all_live else new[1:][live], pool)

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


# The fast fit (reciprocals, hardware sqrt/divide for the per-row/column scale
# math) stays within the kernel's bound against the reference (one quantization
# step, at rounding boundaries), as the exact one does, and is ~20% faster on
# the H200 (docs/kernels.md).
FAST_DECODE = True
QK_L2_EPS = 1e-6  # vLLM's GDN kernels: x / sqrt(sum x^2 + eps)


def packed_decode(records, slots, plan, mixed_qkv, a, b, A_log, dt_bias, num_k_heads: int, out,
                  fast: bool = FAST_DECODE) -> None:
    """One decode token per request on packed records, in place.

    ``records [slots, size]`` uint8, any slot stride (vLLM's state view);
    ``slots [N]`` the requests' slot indices (below 1: padding, output zero,
    nothing touched); ``mixed_qkv [N, 2 H_k K + H V]`` after the conv; ``a,
    b [N, H]``; ``out [N, H, V]`` contiguous (the layer's output). The inputs
    are prepared as vLLM's decode kernels do it for an FP32 state (q and k
    L2-normalised, q scaled by K^-1/2, ``g = -exp(A_log) softplus(a +
    dt_bias)``, ``beta = sigmoid(b)``, all in fp32); the Triton step then
    reads each record, applies the gated delta rule, writes the readout of the
    unquantized new state and packs the state back with the plan's fit.
    """
    lay = plan.layout
    n, kd, vd, hv = mixed_qkv.shape[0], lay.k_dim, lay.v_dim, len(lay.bits)
    qk_dim = 2 * num_k_heads * kd
    if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != qk_dim + hv * vd:
        raise ValueError(f"mixed_qkv must be [N, {qk_dim + hv * vd}] ({num_k_heads} key heads of {kd}, {hv} value "
                         f"heads of {vd}), got {tuple(mixed_qkv.shape)}")
    qk = mixed_qkv[:, :qk_dim].float().reshape(n, 2 * num_k_heads, kd)
    qk = qk / torch.sqrt((qk * qk).sum(-1, keepdim=True) + QK_L2_EPS)
    q, k = qk[:, :num_k_heads] * kd**-0.5, qk[:, num_k_heads:]
    v = mixed_qkv[:, qk_dim:].reshape(n, hv, vd)
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    from vllm_kvq.kernels.stepquant.triton_step import step_  # Triton: imported only where it runs

    step_(records, slots, plan, q, k, v, g, beta, out=out, fast=fast)


def decode_plan(pool: LayerPool, device: torch.device):
    """The Triton step's plan for this layer's decode batches, or None when
    they stay staged (``kvq.kernels = "reference"``, or a layout the kernel
    does not take)."""
    if pool.kernels == "reference":
        return None
    if pool.step_plan is None:
        from vllm_kvq.kernels.stepquant.triton_step import StepPlan

        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the STEPQuant step's tables must be built before a CUDA graph capture")

        try:
            pool.step_plan = StepPlan(pool.layout, pool.impact, device, pool.fit)
        except ValueError as e:
            from vllm.logger import init_logger

            init_logger(__name__).warning("STEPQuant decode stays staged: %s", e)
            pool.step_plan = False
    return pool.step_plan or None


def _is_decode_batch(md) -> bool:
    return md.spec_sequence_masks is None and md.num_prefills == 0 and md.num_decodes > 0


def _fused_decode(layer, md, plan, mixed_qkv, b, a, core_attn_out) -> None:
    """vLLM's non-speculative decode branch with the packed step: the conv
    update on the native conv state, as vLLM runs it, then :func:`packed_decode`
    on the layer's records."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    layer_pool(layer).triton_calls += 1
    n = md.num_actual_tokens
    conv, records = layer.kv_cache
    slots = md.non_spec_state_indices_tensor[:n]
    weight = layer.conv1d.weight
    qkv = causal_conv1d_update(
        mixed_qkv[:n], conv if is_conv_state_dim_first() else conv.transpose(-1, -2),
        weight.view(weight.size(0), weight.size(2)), layer.conv1d.bias, layer.activation,
        conv_state_indices=slots, validate_data=False)
    packed_decode(records, slots, plan, qkv, a[:n], b[:n], layer.A_log, layer.dt_bias,
                  layer.num_k_heads // layer.tp_size, core_attn_out[:n])


def staged_forward_core(forward_core):
    """The CUDA path, ``layer._forward_core(mixed_qkv, b, a, out)``, which
    finds its metadata in vLLM's forward context: decode batches go through
    the Triton step on the records in place, other batches are staged."""

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
        if _is_decode_batch(md):
            plan = decode_plan(pool, self.kv_cache[1].device)
            if plan is not None:
                return _fused_decode(self, md, plan, mixed_qkv, b, a, core_attn_out)
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
    packed pool, this rank's head widths and how many decode batches ran the
    Triton step from Python (``triton_calls``: a CUDA graph replay runs it
    without Python, so with graphs this counts warm-ups and captures)."""
    out = []
    for module in model.modules():
        if hasattr(module, "_kvq_native_dtypes") and getattr(module, "kv_cache", None):
            conv, ssm = module.kv_cache
            pool = module.__dict__.get("_kvq_pool")
            out.append({"layer": module.layer_idx, "shape": list(ssm.shape[1:]), "dtype": str(ssm.dtype),
                        "page_bytes": conv.stride(0) * conv.element_size(),
                        "bits": list(pool.layout.bits) if pool else None,
                        "triton_calls": pool.triton_calls if pool else 0})
    return out
