"""The quantized gated-delta-net state pool: each GDN layer's packed records.

vLLM keeps every GDN layer's recurrent state per request slot as
``[HV, V, K]`` in FP32. With ``kvq.state`` set, the slot's state bytes become
one packed record (``kernels/stepquant/format.py``) and vLLM's page shrinks with
it (the GDN seam, :mod:`vllm_kvq.hooks.gdn`, declares the record and stages
vLLM's own GDN step around it). Here: a layer's pool (layout, impacts, its
Triton step's tables), the codec calls, and the decode step on packed
records in place: the fused Triton step (``kernels/stepquant/triton_step.py``)
at the slots of vLLM's state indices, inside vLLM's page (the record's slot
stride is the page size).
"""

from __future__ import annotations

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


# The fast fit (reciprocals, hardware sqrt/divide for the per-row/column scale
# math) stays within the kernel's bound against the reference (one quantization
# step, at rounding boundaries), as the exact one does, and is ~20% faster on
# the H200 (docs/kernels.md).
FAST_DECODE = True


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
    q, k = codec.normalize_qk(qk[:, :num_k_heads], qk[:, num_k_heads:])
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


