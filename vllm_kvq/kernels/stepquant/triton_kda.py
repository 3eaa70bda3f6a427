"""The split STEPQuant step on KDA records (``kda.py``), as for GDN
(``triton_step.py``), for rows of mixed widths; twin of :func:`kda.step`.
Every row of a head has its own width, so a tile reads each row through its
own byte offset, width and 2^(8-b) unit from the layer's tables. The
foreground takes vLLM's raw KDA decode inputs and gates them as vLLM's decode
kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.stepquant.kda import KdaLayout
from vllm_kvq.kernels.stepquant.triton_codes import fp16_round, head_record


@triton.jit
def _rows(tab_bits, tab_off, h, i3, K: tl.constexpr):
    """Per row ``[1, 1, K]``: width, byte offset, pivot flag, qmax and 2^(8-b) (float)."""
    bits = tl.load(tab_bits + h * K + i3)
    off = tl.load(tab_off + h * K + i3)
    piv = bits == 16
    qm = tl.where(piv, 0, (1 << (bits - 1)) - 1).to(tl.float32)
    unit = tl.where(piv, 1.0, _pow2(8 - bits))
    return bits, off, piv, qm, unit


@triton.jit
def _quad_codes(rec, rec16, bits, off, piv, qm, a3, b3):
    """Signed codes ``q`` of integer rows (0 on pivot rows) and the fp16
    values of pivot rows (0 elsewhere), ``[4, TQ, K]``, of column quads b3."""
    nbytes = bits // 2  # a quad of a b-bit row: b / 2 whole bytes
    at = rec + off + b3 * nbytes
    word = tl.zeros(at.shape, tl.int32)
    for byte in tl.static_range(4):
        word = word | (tl.load(at + byte, mask=(byte < nbytes) & ~piv, other=0).to(tl.int32) << (8 * byte))
    u = (word >> (bits * a3)) & ((1 << bits) - 1)
    q = tl.where(piv, 0.0, u.to(tl.float32) - qm)
    pv = tl.load(rec16 + off // 2 + 4 * b3 + a3, mask=piv, other=0.0).to(tl.float32)
    return q, pv


@triton.jit
def _round_clamp(t, qm):
    """Nearest integer (half to even, as torch.round) within ±qm."""
    return (tl.minimum(tl.maximum(t, -qm), qm) + 12582912.0) - 12582912.0


@triton.jit
def _pow2(e):
    """2^e for integer tensors e in [-126, 127], exactly."""
    return ((127 + e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def kda_foreground_kernel(
    pool, pool16, idx_ptr, s_idx, slot_stride, min_slot,
    tab_bits, tab_off, tab_rows, tab_cols,
    mixed_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, lower_bound, out_ptr,
    slots_ptr, delta_ptr, part_ptr, keys_ptr, decay_ptr,
    s_mix, s_gn, s_bn, H,
    K: tl.constexpr, V: tl.constexpr, TILE: tl.constexpr, ALIGN: tl.constexpr, LOWER: tl.constexpr,
):
    h = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    TQ: tl.constexpr = TILE // 4
    scratch = n * H + h
    slot, rec, rec16 = head_record(pool, pool16, idx_ptr, s_idx, n, slot_stride, ALIGN)
    if h == 0:
        tl.store(slots_ptr + n, slot.to(tl.int32))
    if slot < min_slot:
        for t in range(V // TILE):
            col2 = t * TILE + 4 * tl.arange(0, TQ)[None, :] + tl.arange(0, 4)[:, None]
            tl.store(out_ptr + scratch * V + col2, tl.zeros((4, TQ), tl.float32))
    else:
        a3 = tl.arange(0, 4)[:, None, None]
        i3 = tl.arange(0, K)[None, None, :]
        bits, off, piv, qm, unit = _rows(tab_bits, tab_off, h, i3, K)
        row = mixed_ptr + n * s_mix
        q3 = tl.load(row + h * K + i3).to(tl.float32)
        k3 = tl.load(row + (H + h) * K + i3).to(tl.float32)
        q3 = q3 / tl.sqrt(tl.sum(q3 * q3, axis=2, keep_dims=True) + 1e-6) * (1.0 / tl.sqrt(K * 1.0))
        k3 = k3 / tl.sqrt(tl.sum(k3 * k3, axis=2, keep_dims=True) + 1e-6)
        g = tl.load(g_ptr + n * s_gn + h * K + i3).to(tl.float32) + tl.load(dtb_ptr + h * K + i3).to(tl.float32)
        a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        if LOWER:
            g = lower_bound * tl.sigmoid(a * g)
        else:
            g = -a * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
        decay = tl.exp(g)
        beta = tl.sigmoid(tl.load(beta_ptr + n * s_bn + h).to(tl.float32))
        r = tl.load(rec16 + tl.load(tab_rows + h) // 2 + i3).to(tl.float32)
        dr = decay * tl.where(piv, 1.0, r * unit)  # S = dr (c q), or dr v on pivot rows
        kq = tl.sum(k3 * q3, axis=2)
        cp = rec16 + tl.load(tab_cols + h) // 2
        acc = tl.zeros((4, TQ, K), tl.float32)
        for t in range(V // TILE):
            quads = t * TQ + tl.arange(0, TQ)
            col2 = 4 * quads[None, :] + tl.arange(0, 4)[:, None]
            q, pv = _quad_codes(rec, rec16, bits, off, piv, qm, a3, quads[None, :, None])
            c = tl.load(cp + col2).to(tl.float32)
            s = dr * tl.where(piv, pv, c[:, :, None] * q)
            delta = beta * (tl.load(row + 2 * H * K + h * V + col2).to(tl.float32) - tl.sum(s * k3, axis=2))
            tl.store(out_ptr + scratch * V + col2, tl.sum(s * q3, axis=2) + kq * delta)
            tl.store(delta_ptr + scratch * V + col2, delta)
            acc += tl.abs(s + k3 * delta[:, :, None])
        tl.store(part_ptr + scratch * K + i3, tl.sum(tl.sum(acc, axis=0, keep_dims=True), axis=1, keep_dims=True))
        tl.store(keys_ptr + scratch * K + i3, k3)
        tl.store(decay_ptr + scratch * K + i3, decay)


@triton.jit
def kda_writeback_kernel(
    pool, pool16, slots_ptr, slot_stride, min_slot,
    tab_bits, tab_off, tab_rows, tab_cols, w_ptr,
    delta_ptr, part_ptr, keys_ptr, decay_ptr, H,
    K: tl.constexpr, V: tl.constexpr, TILE: tl.constexpr, ALIGN: tl.constexpr,
):
    h = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    slot, rec, rec16 = head_record(pool, pool16, slots_ptr, 1, n, slot_stride, ALIGN)
    if slot >= min_slot:
        TQ: tl.constexpr = TILE // 4
        scratch = n * H + h
        a3 = tl.arange(0, 4)[:, None, None]
        i3 = tl.arange(0, K)[None, None, :]
        bits, off, piv, qm, unit = _rows(tab_bits, tab_off, h, i3, K)
        w = tl.load(w_ptr + h * K + i3)
        kk = tl.load(keys_ptr + scratch * K + i3)
        decay = tl.load(decay_ptr + scratch * K + i3)
        at_r = rec16 + tl.load(tab_rows + h) // 2 + i3
        r_old = tl.load(at_r).to(tl.float32)
        mag = tl.maximum(tl.load(part_ptr + scratch * K + i3) * (1.0 / V), 1e-20)
        r = tl.where(piv, 0.0, fp16_round(tl.sqrt(mag / w)))
        # the old ones are in registers; the barrier: every warp has read them (a row's factor is loaded by
        # threads of several warps, stored by one; triton_writeback.py's note)
        tl.debug_barrier()
        tl.store(at_r, r.to(tl.float16))
        dr = decay * tl.where(piv, 1.0, r_old * unit)
        # y = X / r, codes y / (c 2^(8-b)): through the rows' reciprocals (2^(b-8) exact) and the columns'
        r_inv = tl.where(piv, 0.0, 1.0 / tl.where(piv, 1.0, r))
        u_inv = tl.where(piv, 0.0, _pow2(bits - 8))
        span_inv = u_inv / tl.maximum(qm, 1.0)  # 1 / (qmax 2^(8-b)): a row's reach in 8-bit steps
        ru = r * unit  # X ~ r 2^(8-b) q
        cp = rec16 + tl.load(tab_cols + h) // 2
        for t in range(V // TILE):
            quads = t * TQ + tl.arange(0, TQ)
            b3 = quads[None, :, None]
            col2 = 4 * quads[None, :] + tl.arange(0, 4)[:, None]
            q, pv = _quad_codes(rec, rec16, bits, off, piv, qm, a3, b3)
            c_old = tl.load(cp + col2).to(tl.float32)[:, :, None]
            x = dr * tl.where(piv, pv, c_old * q) + kk * tl.load(delta_ptr + scratch * V + col2)[:, :, None]
            tl.debug_barrier()  # the tile's codes and column scales read by every warp before any is rewritten
            tl.store(rec16 + off // 2 + 4 * b3 + a3, x.to(tl.float16), mask=piv)
            y = x * r_inv  # 0 on pivot rows
            c0 = fp16_round(tl.max(tl.abs(y) * span_inv, axis=2))
            q0 = _round_clamp((y * u_inv) * (1.0 / c0)[:, :, None], qm)
            p = (w * w * ru) * q0  # the w²-weighted refit: sum w² (r n q0) X / sum w² (r n q0)²
            num = tl.sum(p * x, axis=2)
            den = tl.sum(p * (ru * q0), axis=2)
            c = tl.where(den > 0, fp16_round(num / tl.maximum(den, 1e-30)), c0)
            u = (_round_clamp((y * u_inv) * (1.0 / c)[:, :, None], qm) + qm).to(tl.int32)
            word = tl.sum(u << (bits * a3), axis=0, keep_dims=True)  # [1, TQ, K]: disjoint bits
            nbytes = bits // 2
            for byte in tl.static_range(4):
                tl.store(rec + off + b3 * nbytes + byte, ((word >> (8 * byte)) & 255).to(tl.uint8),
                         mask=(byte < nbytes) & ~piv)
            tl.store(cp + col2, c.to(tl.float16))


class KdaPlan:
    """Device tables of one layer's KDA layout and its impacts."""

    def __init__(self, layout: KdaLayout, impact: torch.Tensor, device):
        k, v = layout.k_dim, layout.v_dim
        if k & (k - 1) or v & (v - 1) or v < 32:
            raise ValueError(f"the KDA step needs power-of-two K and V >= 32, got K={k} V={v}")
        rows, scales, cols, _ = layout.tables
        i32 = dict(dtype=torch.int32, device=device)
        self.layout = layout
        self.bits = torch.tensor(layout.bits, **i32)
        self.offsets = torch.tensor(rows, **i32)
        self.rows = torch.tensor(scales, **i32)
        self.cols = torch.tensor(cols, **i32)
        self.impact = impact.to(device=device, dtype=torch.float32).contiguous()


class KdaScratch:
    """What the foreground leaves the writeback, per batch row (fp32): δ [H,
    V], row sums of |X|, keys and decays [H, K], and the slot."""

    def __init__(self, layout: KdaLayout, capacity: int, device):
        h, kd, vd = len(layout.bits), layout.k_dim, layout.v_dim
        f32 = dict(dtype=torch.float32, device=device)
        self.capacity = capacity
        self.slots = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.delta = torch.zeros(capacity, h, vd, **f32)
        self.parts, self.keys, self.decay = (torch.zeros(capacity, h, kd, **f32) for _ in range(3))


def _align(pool: torch.Tensor) -> int:
    if pool.dtype != torch.uint8 or pool.stride(1) != 1 or pool.stride(0) % 2 or pool.storage_offset() % 2:
        raise ValueError("the pool must be uint8 [slots, size] with unit byte stride and an even slot stride")
    return 4 if pool.stride(0) % 4 == 0 else 2


def kda_foreground_(pool, state_indices, plan: KdaPlan, scratch: KdaScratch, mixed_qkv, raw_g, raw_beta, A_log,
                    dt_bias, out, lower_bound: float | None = None, min_slot: int = 1, tile: int = 32,
                    num_warps: int = 8):
    """The readout of one KDA decode token per request into ``out [N, H, V]``
    from vLLM's raw inputs: ``mixed_qkv [N, 2 H K + H V]`` (post-conv),
    ``raw_g [N, H, K]``, ``raw_beta [N, H]``, ``A_log [H]``, ``dt_bias [H
    K]``; the records are only read."""
    lay = plan.layout
    h, kd, vd, n = len(lay.bits), lay.k_dim, lay.v_dim, mixed_qkv.shape[0]
    if n > scratch.capacity:
        raise ValueError(f"a batch of {n} requests exceeds the scratch's {scratch.capacity} rows")
    if raw_g.stride(-1) != 1 or raw_g.stride(-2) != kd or mixed_qkv.stride(-1) != 1:
        raise ValueError("raw_g must be contiguous within a token and mixed_qkv in its last dimension")
    if n:
        kda_foreground_kernel[(h, n)](
            pool, pool.view(torch.float16), state_indices, state_indices.stride(0), pool.stride(0), min_slot,
            plan.bits, plan.offsets, plan.rows, plan.cols, mixed_qkv, raw_g, raw_beta, A_log, dt_bias,
            float(lower_bound or 0.0), out, scratch.slots, scratch.delta, scratch.parts, scratch.keys, scratch.decay,
            mixed_qkv.stride(0), raw_g.stride(0), raw_beta.stride(0), h,
            K=kd, V=vd, TILE=min(tile, vd), ALIGN=_align(pool), LOWER=lower_bound is not None, num_warps=num_warps)
    return out


def kda_writeback_(pool, plan: KdaPlan, scratch: KdaScratch, n: int, min_slot: int = 1, tile: int = 16,
                   num_warps: int = 8) -> None:
    """Fit and pack the states of the last :func:`kda_foreground_` on this scratch, in place."""
    lay = plan.layout
    if n:
        kda_writeback_kernel[(len(lay.bits), n)](
            pool, pool.view(torch.float16), scratch.slots, pool.stride(0), min_slot,
            plan.bits, plan.offsets, plan.rows, plan.cols, plan.impact,
            scratch.delta, scratch.parts, scratch.keys, scratch.decay, len(lay.bits),
            K=lay.k_dim, V=lay.v_dim, TILE=min(tile, lay.v_dim), ALIGN=_align(pool), num_warps=num_warps)


def kda_step_(pool, state_indices, plan: KdaPlan, mixed_qkv, raw_g, raw_beta, A_log, dt_bias, out,
              lower_bound: float | None = None, min_slot: int = 1, scratch: KdaScratch | None = None):
    """Both halves on the current stream: one KDA decode token per request, in place."""
    n = mixed_qkv.shape[0]
    scratch = scratch or KdaScratch(plan.layout, max(n, 1), pool.device)
    kda_foreground_(pool, state_indices, plan, scratch, mixed_qkv, raw_g, raw_beta, A_log, dt_bias, out,
                    lower_bound, min_slot)
    kda_writeback_(pool, plan, scratch, n, min_slot)
    return out

