"""FP32 token-by-token gated delta rule in math orientation ``S[k, v]``.

Calibration needs the state after every update (snapshots) and the exact
inputs of every step, in the orientation the STEPQuant codec uses (key rows,
value columns). This loop is a drop-in for transformers'
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``: same
arguments, same outputs, so the model computes what it always computes.

Per head and token::

    S ← exp(g)·S;  residual = v − Sᵀk;  S ← S + k (β·residual)ᵀ;  y = Sᵀq

with q, k L2-normalised (when asked, as the kernels do) and q scaled by K^-½.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_kvq.calib import single_thread
from vllm_kvq.kernels.stepquant.reference import normalize_qk

def prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel: bool):
    """Kernel inputs ``[B, T, H, D]`` / ``[B, T, H]`` → fp32 ``[B, H, T, ...]``; HK key
    heads are expanded as transformers does (value head h reads key head ``h // (HV / HK)``)."""
    hv, hk = value.shape[2], key.shape[2]
    if hk != hv:
        if hv % hk:
            raise ValueError(f"{hv} value heads cannot share {hk} key heads")
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = normalize_qk(q, k)
    else:
        q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta


def run_recurrence(q, k, v, g, beta, initial_state: torch.Tensor | None = None,
                   on_update: Callable[[int, torch.Tensor], None] | None = None):
    """The loop on prepared fp32 inputs ``[B, H, T, D]``; returns (y ``[B, H, T, V]``, S ``[B, H, K, V]``).
    ``on_update(t, S)`` sees the live state after update t (clone to keep it)."""
    b, h, t_len, kd = k.shape
    vd = v.shape[-1]
    s = torch.zeros(b, h, kd, vd, dtype=torch.float32, device=v.device) if initial_state is None \
        else initial_state.float().clone()
    y = torch.empty(b, h, t_len, vd, dtype=torch.float32, device=v.device)
    # [B*H, T, ...] views so each step is a few batched small matmuls.
    s3 = s.view(b * h, kd, vd)
    decay = g.exp().reshape(b * h, t_len, 1, 1)
    k3, q3 = k.reshape(b * h, t_len, kd), q.reshape(b * h, t_len, kd)
    v3, beta3 = v.reshape(b * h, t_len, vd), beta.reshape(b * h, t_len, 1, 1)
    y3 = y.view(b * h, t_len, vd)
    with single_thread():
        for t in range(t_len):
            s3.mul_(decay[:, t])
            kt = k3[:, t].unsqueeze(-1)  # [BH, K, 1]
            residual = v3[:, t].unsqueeze(-2) - kt.transpose(-1, -2) @ s3  # [BH, 1, V]
            s3.baddbmm_(kt, beta3[:, t] * residual)
            y3[:, t] = (q3[:, t].unsqueeze(-2) @ s3).squeeze(-2)
            if on_update is not None:
                on_update(t, s)
    return y, s


def gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                     on_update=None, on_inputs=None, cu_seqlens=None, **_ignored):
    """transformers-compatible entry point (``chunk_size`` is ignored); ``on_inputs(q, k, v, g, beta)``
    receives the prepared fp32 inputs once."""
    if cu_seqlens is not None:
        raise NotImplementedError("packed (varlen) sequences: calibrate with one sequence per batch row")
    q, k, v, g32, b32 = prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    if on_inputs is not None:
        on_inputs(q, k, v, g32, b32)
    y, s = run_recurrence(q, k, v, g32, b32, initial_state, on_update)
    return y.transpose(1, 2).contiguous().to(query.dtype), (s if output_final_state else None)
