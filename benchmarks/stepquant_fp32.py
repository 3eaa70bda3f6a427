"""The dense FP32 gated delta-rule decode step that the packed kernel replaces
(what vLLM runs on an FP32 state), kept here as the speed and accuracy
baseline.

State pool ``[slots, H, K, V]`` fp32 in math orientation, updated in place.
Each program owns ``BV`` value columns of one (request, head) with all K key
rows, so ``Sᵀk`` and ``Xᵀq`` reduce inside the program (the tiling of vLLM's
``fused_recurrent`` kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp32_step_kernel(
    state, idx_ptr, min_slot, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    sqn, sqh, skn, skh, svn, svh, sgn, sgh, sbn, sbh, H, QK_GROUP,
    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
):
    jv = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, K)
    cols = jv * BV + tl.arange(0, BV)
    out = out_ptr + (n * H + h) * V + cols
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot < min_slot:
        tl.store(out, tl.zeros((BV,), tl.float32))
    else:
        kh = h // QK_GROUP
        kk = tl.load(k_ptr + n * skn + kh * skh + rows).to(tl.float32)
        qq = tl.load(q_ptr + n * sqn + kh * sqh + rows).to(tl.float32)
        vv = tl.load(v_ptr + n * svn + h * svh + cols).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + n * sgn + h * sgh).to(tl.float32))
        beta = tl.load(beta_ptr + n * sbn + h * sbh).to(tl.float32)
        p = state + ((slot * H + h) * K + rows[:, None]) * V + cols[None, :]
        s = decay * tl.load(p)
        resid = vv - tl.sum(s * kk[:, None], axis=0)
        x = s + kk[:, None] * (beta * resid)[None, :]
        tl.store(p, x)
        tl.store(out, tl.sum(x * qq[:, None], axis=0))


def fp32_step_(state, state_indices, q, k, v, g, beta, out=None, min_slot: int = 1, block_v: int = 32,
               num_warps: int = 4) -> torch.Tensor:
    """One token per request on the FP32 pool ``[slots, H, K, V]``, in place;
    same inputs and output as :func:`triton_step.step_`."""
    _, h, kd, vd = state.shape
    n = v.shape[0]
    if out is None:
        out = torch.empty(n, h, vd, dtype=torch.float32, device=v.device)
    if n == 0:
        return out
    bv = min(block_v, vd)
    _fp32_step_kernel[(vd // bv, h, n)](
        state, state_indices, min_slot, q, k, v, g, beta, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), h, h // q.shape[1],
        K=kd, V=vd, BV=bv, num_warps=num_warps)
    return out
