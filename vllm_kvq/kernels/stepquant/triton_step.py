"""Fused STEPQuant decode step on packed records: two kernels per width.

Twin of :func:`reference.step`. The fit couples a head's whole ``K x V``
state twice: each row factor needs its key row's mean ``|X|`` over every value
column, and each column scale needs every key row. One program holding a whole
128 x 128 head in registers is latency-bound (one program per SM, spills), so
the step is cut where those dependencies allow:

1. ``_rows_kernel``, one program per (request, value head), streams the record
   in blocks of ``RB`` key rows. Pass 1 sums ``Sᵀk`` and ``Sᵀq`` (``S = exp(g)
   X̂``) into per-thread partials, reduced once at the end: that gives ``δ = β
   (v - Sᵀk)`` and the readout ``out = Sᵀq + (k·q) δ`` of the unquantized ``X =
   S + k δᵀ``. Pass 2 rebuilds ``X`` block by block and writes the new row
   factors (mean ``|X|`` and the impact, per 32-column group for INT2; the
   rowwise baseline's absmax) into the record, after copying the old ones to a
   scratch row: the second kernel still needs them.
2. ``_fit_kernel``, one program per (request, value head, ``TILE`` value
   columns) with all K key rows (the FP32 update's own tiling), rebuilds its
   columns of ``X`` from the old codes, old column scales, saved old row
   factors and ``δ``, fits its column scales against the new row factors
   (absmax, then one w²-weighted least-squares refit) and writes its codes and
   column scales. Pivot heads are rebuilt and stored as fp16 here.

Tiles put the 4 columns of a code group first, so the codes of a byte (of a
6-bit 24-bit word) stay in one thread: ``[4, rows, columns/4]`` in the rows
kernel, ``[4, columns/4, rows]`` in the fit kernel (key rows last: Triton then
gives each thread several rows, and the column sums stay mostly in a thread).
The record is rewritten in place: the first kernel touches only row factors
(after reading them), the second only its own columns. Scratch (``δ``, V
floats, and the old row factors, K floats, or K·V/32 when the layer has INT2
heads: 1 KB or 2.5 KB per 128 x 128 head) comes from torch's allocator; no host
sync, fixed grids: CUDA-graph safe.

Records live in a pool ``[slots, size]`` of uint8 whose slot stride may be
larger than the record (vLLM's state view: the record sits inside a larger
hybrid page, after the conv state); ``state_indices [N]`` (any stride, e.g. a
column of vLLM's block table) names each request's slot, and requests whose
index is below ``min_slot`` (vLLM's padding and null slot 0: ``min_slot=1``)
get a zero output and touch nothing. Each width is a constexpr (one launch pair
per width present in the layer).

The fit is the plan's: ``stepquant`` (the dual-axis fit with the impact
factors) or ``rowwise`` (the uniform baseline: one absmax scale per key row,
unit column scales), as in :func:`reference.fit_heads`.

``fast=True`` (the default) multiplies by reciprocals of the row and column
scales instead of dividing every element, folds the decay into the row
factors and uses the hardware sqrt/divide for the per-row/column scale math;
``fast=False`` keeps the reference's correctly rounded divisions element by
element (from correctly rounded reciprocals and one FMA correction). Either
way codes differ from the reference's only where a value sits within an ulp
or two of a rounding boundary (sums also run in another order); the tests
bound that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.stepquant.format import FITS, INT2_GROUP, PIVOT, StateLayout


@triton.jit
def _fp16_round(x):
    return tl.minimum(tl.maximum(x, 5.960464477539063e-08), 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def _div(x, d, d_inv):
    """``x / d`` correctly rounded from ``d_inv = 1 / d`` (itself correctly
    rounded): one Newton correction with exact FMA residuals (Markstein), three
    operations an element instead of a full IEEE division."""
    q = x * d_inv
    return tl.fma(tl.fma(-q, d, x), d_inv, q)


@triton.jit
def _rcp(x, ASM: tl.constexpr):
    """``1 / x`` for the fast fit's positive fp16-valued scales: the hardware
    reciprocal (``rcp.approx``, about 1 ulp) where compiled, instead of the
    range-checked full division; a plain division in Triton's interpreter."""
    if ASM:
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = 1.0 / x
    return y


@triton.jit
def _levels(t, BITS: tl.constexpr):
    """Nearest signed level of ``t`` (``reference.quantize_levels``) as a float,
    and its unsigned code as int32.

    No float<->int conversions (a quarter-rate pipe): adding 1.5 * 2**23 to the
    clamped value rounds it half to even, like torch.round, and leaves the
    integer in the low mantissa bits.
    """
    if BITS == 2:
        pos = t >= 0
        big = tl.abs(t) >= 2.0
        z = tl.where(pos, 1.0, -1.0) * tl.where(big, 3.0, 1.0)
        u = tl.where(pos, tl.where(big, 3, 2), tl.where(big, 0, 1))
    else:
        QM: tl.constexpr = (1 << (BITS - 1)) - 1
        f = tl.minimum(tl.maximum(t, -QM * 1.0), QM * 1.0) + 12582912.0
        z = f - 12582912.0
        u = f.to(tl.int32, bitcast=True) - (0x4B400000 - QM)
    return z, u


@triton.jit
def _signed(u, BITS: tl.constexpr):
    """Signed level (float) of unsigned codes ``u`` (int32), without an int->float conversion."""
    f = (u | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + u
    if BITS == 2:
        z = (f - 8388608.0) * 2.0 - 3.0
    else:
        z = f - (8388608.0 + ((1 << (BITS - 1)) - 1))
    return z


@triton.jit
def _load_codes(base, a3, i3, b3, BITS: tl.constexpr, V: tl.constexpr):
    """Raw code bytes of key rows ``i3`` and column quads ``b3`` of the packed
    head at ``base`` (uint8 pointer), as (b0, b1, b2), b1 and b2 used by 6-bit
    codes only; :func:`_codes` unpacks them. Split so that a loop issues the
    next row block's loads before it works on this one's."""
    if BITS == 16:  # a pivot: the fp16 values themselves
        b0 = tl.load(base.to(tl.pointer_type(tl.float16)) + i3 * V + 4 * b3 + a3)
        b1 = b0
        b2 = b0
    elif BITS == 8:
        b0 = tl.load(base + i3 * V + 4 * b3 + a3)
        b1 = b0
        b2 = b0
    elif BITS == 6:  # 4 codes in the 24-bit word at byte 3 b of the row
        at = base + i3 * (3 * V // 4) + 3 * b3
        b0 = tl.load(at)
        b1 = tl.load(at + 1)
        b2 = tl.load(at + 2)
    elif BITS == 4:  # byte 2 b + a // 2
        b0 = tl.load(base + i3 * (V // 2) + 2 * b3 + a3 // 2)
        b1 = b0
        b2 = b0
    else:  # byte b
        b0 = tl.load(base + i3 * (V // 4) + b3)
        b1 = b0
        b2 = b0
    return b0, b1, b2


@triton.jit
def _codes(b0, b1, b2, a3, BITS: tl.constexpr):
    """Unsigned codes (int32) ``[4, R, Q]`` from :func:`_load_codes`' bytes:
    element (a, i, b) is column ``4 b + a`` of key row i, so each thread holds
    4 consecutive codes of a row (one 6-bit group, one 2-bit byte, two 4-bit
    bytes) and unpacks them from its own bytes."""
    if BITS == 8:
        u = b0.to(tl.int32)
    elif BITS == 6:
        word = b0.to(tl.int32) | (b1.to(tl.int32) << 8) | (b2.to(tl.int32) << 16)
        u = (word >> (6 * a3)) & 63
    elif BITS == 4:  # low nibble first
        u = (b0.to(tl.int32) >> (4 * (a3 % 2))) & 15
    else:  # bits 0-1 first
        u = (b0.to(tl.int32) >> (2 * a3)) & 3
    return u


@triton.jit
def _unpack(base, a3, i3, b3, BITS: tl.constexpr, V: tl.constexpr):
    """Unsigned codes (int32) ``[4, R, Q]`` of key rows ``i3`` and column quads
    ``b3`` (:func:`_load_codes` then :func:`_codes`)."""
    b0, b1, b2 = _load_codes(base, a3, i3, b3, BITS, V)
    return _codes(b0, b1, b2, a3, BITS)


@triton.jit
def _pack_store(u, base, i3, b3, V: tl.constexpr, BITS: tl.constexpr):
    """Store unsigned codes ``u [4, X, Y]`` (int32; element (a, ., .) = column
    ``4 b + a`` of key row i, with the row and quad indices ``i3``, ``b3``
    broadcasting to ``[1, X, Y]``) packed at ``base``; the codes of one byte
    (of one 24-bit word) sit in one thread."""
    a3 = tl.arange(0, 4)[:, None, None]
    if BITS == 8:
        tl.store(base + i3 * V + 4 * b3 + a3, u.to(tl.uint8))
    elif BITS == 4:  # disjoint bits: sum == or
        byte = tl.sum(tl.reshape(u << (4 * (a3 % 2)), (2, 2, u.shape[1], u.shape[2])), axis=1)
        h = tl.arange(0, 2)[:, None, None]
        tl.store(base + i3 * (V // 2) + 2 * b3 + h, byte.to(tl.uint8))
    else:
        word = tl.sum(u << (BITS * a3), axis=0, keep_dims=True)  # [1, X, Y]
        if BITS == 6:
            at = base + i3 * (3 * V // 4) + 3 * b3
            tl.store(at, (word & 255).to(tl.uint8))
            tl.store(at + 1, ((word >> 8) & 255).to(tl.uint8))
            tl.store(at + 2, ((word >> 16) & 255).to(tl.uint8))
        else:
            tl.store(base + i3 * (V // 4) + b3, word.to(tl.uint8))


@triton.jit
def _group_rows(t, R: tl.constexpr, Q: tl.constexpr):
    """``t [R, Q]`` summed over each INT2 group (8 quads = 32 columns) and
    broadcast back: the per-group row sums, ``[R, Q]``."""
    G: tl.constexpr = Q // 8
    s = tl.sum(tl.reshape(t, (R, G, 8)), axis=2)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, G, 8)), (R, Q))


@triton.jit
def _old_rows(rec16, rows_off, rows, BITS: tl.constexpr, V: tl.constexpr, Q: tl.constexpr):
    """Stored row factors of key rows ``rows``, fp32: ``[1, R, Q]`` for INT2
    (one per 32-column group, indexed by quad), else ``[1, R, 1]`` (ones for a
    pivot, which has none)."""
    if BITS == 16:
        r = tl.full((1, rows.shape[0], 1), 1.0, tl.float32)
    elif BITS == 2:
        r = tl.load(rec16 + rows_off // 2 + rows[:, None] * (V // 32) + tl.arange(0, Q)[None, :] // 8)
        r = r.to(tl.float32)[None, :, :]
    else:
        r = tl.load(rec16 + rows_off // 2 + rows).to(tl.float32)[None, :, None]
    return r


@triton.jit
def _row_block(rec, rec16, co, ro, kp, rows, a3, b3, BITS: tl.constexpr, V: tl.constexpr, Q: tl.constexpr):
    """One block of key rows ``rows``: its raw code bytes, old row factors and
    key entries (loads only, so a loop can issue them a block ahead)."""
    b0, b1, b2 = _load_codes(rec + co, a3, rows[None, :, None], b3, BITS, V)
    return b0, b1, b2, _old_rows(rec16, ro, rows, BITS, V, Q), tl.load(kp + rows)


@triton.jit
def _row_factor(mag, w, FAST: tl.constexpr):
    """New row factor ``sqrt(mean |X| / impact)``, fp16-rounded; correctly
    rounded unless FAST."""
    if FAST:
        r = _fp16_round(tl.sqrt(mag / w))
    else:
        r = _fp16_round(tl.sqrt_rn(tl.math.div_rn(mag, w)))
    return r


@triton.jit
def _rebuild(z, r, c, decay, FAST: tl.constexpr):
    """``S = exp(g) r c z`` from signed codes ``z``, old row factors ``r`` and
    column scales ``c`` (all broadcasting to z's shape); the reference's order
    unless FAST (decay folded into the row factors)."""
    if FAST:
        s = ((decay * r) * c) * z
    else:
        s = decay * ((r * c) * z)
    return s


@triton.jit
def _head_record(pool, pool16, idx_ptr, s_idx, n, slot_stride, ALIGN: tl.constexpr):
    """(slot, uint8 and fp16 pointers to its record) of request n."""
    slot = tl.load(idx_ptr + n * s_idx).to(tl.int64)
    base = tl.multiple_of(slot * slot_stride, ALIGN)
    return slot, pool + base, pool16 + base // 2


@triton.jit
def _rows_kernel(
    pool, pool16, idx_ptr, s_idx, slot_stride, min_slot,
    heads_ptr, codes_ptr, rows_ptr, cols_ptr,
    w_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, delta_ptr, rold_ptr,
    sqn, sqh, skn, skh, svn, svh, sgn, sgh, sbn, sbh, H, QK_GROUP,
    BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, RB: tl.constexpr, FAST: tl.constexpr,
    ALIGN: tl.constexpr, FIT: tl.constexpr, ROWWISE: tl.constexpr, RG: tl.constexpr,
):
    """Program (j, n): readout, ``δ`` and new row factors of head ``heads[j]``
    of request n (see the module docstring)."""
    j = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    Q: tl.constexpr = V // 4
    h = tl.load(heads_ptr + j)
    col2 = 4 * tl.arange(0, Q)[None, :] + tl.arange(0, 4)[:, None]  # [4, Q] column index
    out = out_ptr + (n * H + h) * V
    slot, rec, rec16 = _head_record(pool, pool16, idx_ptr, s_idx, n, slot_stride, ALIGN)
    if slot < min_slot:
        tl.store(out + col2, tl.zeros((4, Q), tl.float32))
    else:
        a3 = tl.arange(0, 4)[:, None, None]
        b3 = tl.arange(0, Q)[None, None, :]
        kp = k_ptr + n * skn + (h // QK_GROUP) * skh
        qp = q_ptr + n * sqn + (h // QK_GROUP) * sqh
        decay = tl.exp(tl.load(g_ptr + n * sgn + h * sgh).to(tl.float32))
        co = tl.multiple_of(tl.load(codes_ptr + j), ALIGN)
        ro = tl.multiple_of(tl.load(rows_ptr + j), ALIGN)
        cp = rec16 + tl.multiple_of(tl.load(cols_ptr + j), ALIGN) // 2 + col2
        if BITS == 16 or FAST:  # the fast sums apply c after the loop: not held in registers through it
            c = tl.full((4, Q), 1.0, tl.float32)
        else:
            c = tl.load(cp).to(tl.float32)

        # pass 1: Sᵀk and Sᵀq, per-thread partials over the row blocks; each
        # block's loads are issued one block ahead (the last look-ahead wraps
        # to block 0: a valid, unused load)
        acc_k = tl.zeros((4, RB, Q), tl.float32)
        acc_q = tl.zeros((4, RB, Q), tl.float32)
        kq = tl.zeros((RB,), tl.float32)
        rows = tl.arange(0, RB)
        n0, n1, n2, n_r, n_k = _row_block(rec, rec16, co, ro, kp, rows, a3, b3, BITS, V, Q)
        n_q = tl.load(qp + rows)
        for r0 in range(0, K, RB):
            c0, c1, c2, r_old, kk, qq = n0, n1, n2, n_r, n_k.to(tl.float32), n_q.to(tl.float32)
            ahead = (r0 + RB) % K + tl.arange(0, RB)
            n0, n1, n2, n_r, n_k = _row_block(rec, rec16, co, ro, kp, ahead, a3, b3, BITS, V, Q)
            n_q = tl.load(qp + ahead)
            if BITS == 16:
                s = decay * c0.to(tl.float32)
                acc_k += s * kk[None, :, None]
                acc_q += s * qq[None, :, None]
            elif FAST:  # sum z (exp(g) r k) per column, times c at the end: one FMA an element per sum
                z = _signed(_codes(c0, c1, c2, a3, BITS), BITS)
                dr = decay * r_old
                acc_k += z * (dr * kk[None, :, None])
                acc_q += z * (dr * qq[None, :, None])
            else:
                z = _signed(_codes(c0, c1, c2, a3, BITS), BITS)
                s = _rebuild(z, r_old, c[:, None, :], decay, FAST)
                acc_k += s * kk[None, :, None]
                acc_q += s * qq[None, :, None]
            kq += kk * qq
        sk = tl.sum(acc_k, axis=1)
        sq = tl.sum(acc_q, axis=1)
        if FAST and BITS != 16:
            c = tl.load(cp).to(tl.float32)
            sk = sk * c
            sq = sq * c
        vv = tl.load(v_ptr + n * svn + h * svh + col2).to(tl.float32)
        beta = tl.load(beta_ptr + n * sbn + h * sbh).to(tl.float32)
        delta = beta * (vv - sk)
        tl.store(out + col2, sq + tl.sum(kq, axis=0) * delta)
        scratch = n * H + h
        tl.store(delta_ptr + scratch * V + col2, delta)

        # pass 2: X row block by row block -> the new row factors
        if FIT and BITS != 16:
            rows = tl.arange(0, RB)
            n0, n1, n2, n_r, n_k = _row_block(rec, rec16, co, ro, kp, rows, a3, b3, BITS, V, Q)
            n_w = tl.load(w_ptr + h * K + rows)
            for r0 in range(0, K, RB):  # as pass 1: loads one block ahead
                rows = r0 + tl.arange(0, RB)
                c0, c1, c2, r_old, kk, w = n0, n1, n2, n_r, n_k.to(tl.float32), n_w
                ahead = (r0 + RB) % K + tl.arange(0, RB)
                n0, n1, n2, n_r, n_k = _row_block(rec, rec16, co, ro, kp, ahead, a3, b3, BITS, V, Q)
                n_w = tl.load(w_ptr + h * K + ahead)
                z = _signed(_codes(c0, c1, c2, a3, BITS), BITS)
                x = _rebuild(z, r_old, c[:, None, :], decay, FAST) + kk[None, :, None] * delta[:, None, :]
                if ROWWISE:  # r_i = max_j |X_ij| / qmax
                    QMR: tl.constexpr = (1 << (BITS - 1)) - 1
                    r_new = _fp16_round(tl.math.div_rn(tl.max(tl.max(tl.abs(x), axis=0), axis=1), QMR * 1.0))
                elif BITS == 2:  # per 32-column group: [RB, Q], lanes of a group alike
                    w = w[:, None]
                    mag = tl.maximum(_group_rows(tl.sum(tl.abs(x), axis=0), RB, Q) * (1.0 / 32), 1e-20)
                    r_new = _row_factor(mag, w, FAST)
                else:
                    mag = tl.maximum(tl.sum(tl.sum(tl.abs(x), axis=0), axis=1) * (1.0 / V), 1e-20)
                    r_new = _row_factor(mag, w, FAST)
                if BITS == 2:  # quads 8 g .. 8 g + 7 all hold group g: store from the first
                    quad = tl.arange(0, Q)[None, :]
                    at = rows[:, None] * (V // 32) + quad // 8
                    first = (quad % 8) == 0
                    tl.store(rold_ptr + scratch * RG + at, tl.reshape(r_old, (RB, Q)), mask=first)
                    tl.store(rec16 + ro // 2 + at, r_new.to(tl.float16), mask=first)
                else:
                    tl.store(rold_ptr + scratch * RG + rows, tl.reshape(r_old, (RB,)))
                    tl.store(rec16 + ro // 2 + rows, r_new.to(tl.float16))


@triton.jit
def _fit_kernel(
    pool, pool16, idx_ptr, s_idx, slot_stride, min_slot,
    heads_ptr, codes_ptr, rows_ptr, cols_ptr,
    w_ptr, k_ptr, g_ptr, delta_ptr, rold_ptr,
    skn, skh, sgn, sgh, H, QK_GROUP,
    BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TILE: tl.constexpr, FAST: tl.constexpr,
    ALIGN: tl.constexpr, ROWWISE: tl.constexpr, ASM: tl.constexpr, RG: tl.constexpr,
):
    """Program (t, j, n): value columns ``t*TILE ..`` of head ``heads[j]`` of
    request n, all key rows: rebuild X, fit the column scales, write the codes."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    TQ: tl.constexpr = TILE // 4
    slot, rec, rec16 = _head_record(pool, pool16, idx_ptr, s_idx, n, slot_stride, ALIGN)
    if slot >= min_slot:
        h = tl.load(heads_ptr + j)
        rows = tl.arange(0, K)
        quads = t * TQ + tl.arange(0, TQ)
        a3 = tl.arange(0, 4)[:, None, None]
        i3 = rows[None, None, :]  # tiles [4, TQ, K]: key rows last (each thread holds several)
        b3 = quads[None, :, None]
        col2 = 4 * quads[None, :] + tl.arange(0, 4)[:, None]  # [4, TQ]
        scratch = n * H + h
        decay = tl.exp(tl.load(g_ptr + n * sgn + h * sgh).to(tl.float32))
        kk = tl.load(k_ptr + n * skn + (h // QK_GROUP) * skh + rows).to(tl.float32)[None, None, :]
        delta = tl.load(delta_ptr + scratch * V + col2)[:, :, None]
        co = tl.multiple_of(tl.load(codes_ptr + j), ALIGN)
        if BITS == 16:
            at = rec16 + co // 2 + i3 * V + 4 * b3 + a3
            x = decay * tl.load(at).to(tl.float32) + kk * delta
            tl.store(at, x.to(tl.float16))
        else:
            ro = tl.multiple_of(tl.load(rows_ptr + j), ALIGN)
            cp = rec16 + tl.multiple_of(tl.load(cols_ptr + j), ALIGN) // 2 + col2
            if BITS == 2:  # the tile lies in one 32-column group
                grp = (t * TILE) // 32
                r_old = tl.load(rold_ptr + scratch * RG + rows * (V // 32) + grp)
                r = tl.load(rec16 + ro // 2 + rows * (V // 32) + grp).to(tl.float32)
            else:
                r_old = tl.load(rold_ptr + scratch * RG + rows)
                r = tl.load(rec16 + ro // 2 + rows).to(tl.float32)
            z = _signed(_unpack(rec + co, a3, i3, b3, BITS, V), BITS)
            c_old = tl.load(cp).to(tl.float32)[:, :, None]
            r3 = r[None, None, :]
            if FAST:  # y = X / r directly: (exp(g) r_old / r) c z + (k / r) δ, one FMA an element
                r_inv = _rcp(r, ASM)[None, None, :]
                y = (((decay * r_old)[None, None, :] * r_inv) * c_old) * z + (kk * r_inv) * delta
            else:
                x = _rebuild(z, r_old[None, None, :], c_old, decay, FAST) + kk * delta
            if ROWWISE:  # x / r, unit column scales
                if FAST:
                    _, u = _levels(y, BITS)
                else:
                    _, u = _levels(_div(x, r3, tl.math.div_rn(1.0, r3)), BITS)
                c = tl.full((4, TQ), 1.0, tl.float32)
            else:
                QM: tl.constexpr = 3 if BITS == 2 else (1 << (BITS - 1)) - 1
                w3 = tl.load(w_ptr + h * K + rows)[None, None, :]
                if FAST:
                    # column scales by absmax, then one w²-weighted least-squares refit
                    c0 = _fp16_round(tl.max(tl.abs(y), axis=2) * (1.0 / QM))
                    z0, _ = _levels(y * _rcp(c0, ASM)[:, :, None], BITS)
                    # in units of y (x ~ r y): sum w² r² z0 y and sum w² r² z0², 3 ops an element instead of 5
                    p = (w3 * r3) * (w3 * r3) * z0
                    num = tl.sum(p * y, axis=2)
                    den = tl.sum(p * z0, axis=2)
                    c = tl.where(den > 0, _fp16_round(num * _rcp(tl.maximum(den, 1e-30), ASM)), c0)
                    _, u = _levels(y * _rcp(c, ASM)[:, :, None], BITS)
                else:
                    y = _div(x, r3, tl.math.div_rn(1.0, r3))
                    c0 = _fp16_round(tl.math.div_rn(tl.max(tl.abs(y), axis=2), QM * 1.0))
                    z0, _ = _levels(_div(y, c0[:, :, None], tl.math.div_rn(1.0, c0)[:, :, None]), BITS)
                    vals = r3 * z0
                    w2 = w3 * w3
                    num = tl.sum(w2 * vals * x, axis=2)
                    den = tl.sum(w2 * vals * vals, axis=2)
                    c = tl.where(den > 0, _fp16_round(tl.math.div_rn(num, tl.maximum(den, 1e-30))), c0)
                    _, u = _levels(_div(y, c[:, :, None], tl.math.div_rn(1.0, c)[:, :, None]), BITS)
            _pack_store(u, rec + co, i3, b3, V, BITS)
            tl.store(cp, c.to(tl.float16))


LAUNCH = {"rows_block": 8, "rows_warps": 2, "tile": 32, "fit_warps": 4}  # H200 sweep: within 1% of the best, checked compiled


@dataclass
class _Group:
    bits: int
    heads: torch.Tensor
    codes: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


def old_row_floats(layout: StateLayout) -> int:
    """Scratch floats per head for the old row factors between the two
    kernels: K, or K·V/32 when the layer has INT2 heads (one per 32 columns)."""
    return layout.k_dim * (layout.v_dim // INT2_GROUP) if 2 in layout.bits else layout.k_dim


def shape_error(k: int, v: int) -> str | None:
    """Why the step cannot take heads of K x V, or None."""
    if k & (k - 1) or v & (v - 1) or min(k, v) < INT2_GROUP:
        return f"the Triton step needs power-of-two K and V >= {INT2_GROUP}, got K={k} V={v}"
    return None


class StepPlan:
    """Device-side head tables of one layer's layout and its fit (``stepquant``
    or ``rowwise``, as in :func:`reference.fit_heads`), built once (not per step)."""

    def __init__(self, layout: StateLayout, impact: torch.Tensor, device: torch.device | str,
                 fit: str = "stepquant"):
        k, v = layout.k_dim, layout.v_dim
        if why := shape_error(k, v):
            raise ValueError(why)
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
        if fit == "rowwise" and 2 in layout.bits:
            raise ValueError("the rowwise fit has no INT2 form (INT2 keeps one row factor per 32 columns)")
        self.layout = layout
        self.rowwise = fit == "rowwise"
        self.old_row_floats = old_row_floats(layout)
        self.impact = impact.to(device=device, dtype=torch.float32).contiguous()
        slots = layout.heads

        def group(bits: int, ids: list[int]) -> _Group:
            col = lambda f: torch.tensor([f(i) for i in ids], dtype=torch.int32, device=device)  # noqa: E731
            return _Group(bits, col(lambda i: i), col(lambda i: slots[i].codes), col(lambda i: slots[i].rows),
                          col(lambda i: slots[i].cols))

        # widest first: the pivot and 8-bit programs are the longest, start them early
        order = sorted(set(layout.bits), reverse=True)
        self.groups = [group(b, [i for i, x in enumerate(layout.bits) if x == b]) for b in order]


def step_(
    pool: torch.Tensor,
    state_indices: torch.Tensor,
    plan: StepPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    out: torch.Tensor | None = None,
    min_slot: int = 1,
    fast: bool = True,
    launch: dict | None = None,
    readout_only: bool = False,
) -> torch.Tensor:
    """Decode one token per request on the packed pool ``[slots, size]``, in place.

    ``pool`` is uint8 with a unit byte stride inside a record and any even
    slot stride (a view into vLLM's hybrid pages is fine); ``state_indices
    [N]`` any integer vector. ``q, k [N, H or H_k, K]`` (key heads are shared
    by ``H / H_k`` consecutive value heads), ``v [N, H, V]``, ``g, beta [N,
    H]``, any strides with a contiguous last dimension. Returns ``out [N, H,
    V]`` fp32, or writes the given contiguous ``out`` (fp32, bf16 or fp16).
    ``launch``: ``rows_block`` / ``rows_warps`` (first kernel), ``tile`` /
    ``fit_warps`` (second), default ``LAUNCH``. ``readout_only`` runs only the
    first kernel's readout and leaves the records alone (the part on the
    layer's critical path, timed on its own).
    """
    lay = plan.layout
    n, h = v.shape[0], len(lay.bits)
    kd, vd = lay.k_dim, lay.v_dim
    if (pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != lay.size or pool.stride(1) != 1
            or (pool.shape[0] > 1 and pool.stride(0) < lay.size)):
        raise ValueError(f"pool must be uint8 [slots, {lay.size}] with unit stride inside a record, got "
                         f"{tuple(pool.shape)} {pool.dtype} strides {pool.stride()}")
    slot_stride = pool.stride(0)
    if slot_stride % 2 or pool.storage_offset() % 2:
        raise ValueError(f"the pool's slot stride ({slot_stride}) and offset ({pool.storage_offset()}) must be even "
                         "(records hold fp16 scales)")
    if state_indices.dim() != 1 or state_indices.shape[0] < n or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be an int32/int64 vector of at least {n} slots, got "
                         f"{tuple(state_indices.shape)} {state_indices.dtype}")
    if q.shape[1] != k.shape[1] or h % q.shape[1]:
        raise ValueError(f"q/k heads {q.shape[1]}/{k.shape[1]} must divide the {h} value heads")
    if out is None:
        out = torch.empty(n, h, vd, dtype=torch.float32, device=v.device)
    elif (out.shape != (n, h, vd) or not out.is_contiguous()
          or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"out must be a contiguous float [{n}, {h}, {vd}] tensor, got {tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dimension")
    lc = {**LAUNCH, **(launch or {})}
    rb, tile = min(lc["rows_block"], kd), min(lc["tile"], INT2_GROUP, vd)
    delta = torch.empty(n, h, vd, dtype=torch.float32, device=v.device)
    rold = torch.empty(n, h, plan.old_row_floats, dtype=torch.float32, device=v.device)
    align = 4 if slot_stride % 4 == 0 else 2
    head = (pool, pool.view(torch.float16), state_indices, state_indices.stride(0), slot_stride, min_slot)
    for grp in plan.groups:
        tables = (grp.heads, grp.codes, grp.rows, grp.cols)
        _rows_kernel[(grp.heads.numel(), n)](
            *head, *tables, plan.impact, q, k, v, g, beta, out, delta, rold,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), h, h // q.shape[1],
            BITS=grp.bits, K=kd, V=vd, RB=rb, FAST=fast, ALIGN=align, FIT=not readout_only,
            ROWWISE=plan.rowwise, RG=plan.old_row_floats, num_warps=lc["rows_warps"])
    if readout_only:
        return out
    for grp in plan.groups:
        tables = (grp.heads, grp.codes, grp.rows, grp.cols)
        _fit_kernel[(vd // tile, grp.heads.numel(), n)](
            *head, *tables, plan.impact, k, g, delta, rold,
            k.stride(0), k.stride(1), g.stride(0), g.stride(1), h, h // q.shape[1],
            BITS=grp.bits, K=kd, V=vd, TILE=tile, FAST=fast, ALIGN=align, ROWWISE=plan.rowwise,
            ASM=v.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), RG=plan.old_row_floats,
            num_warps=lc["fit_warps"])
    return out


def step(records, layout, impact, q, k, v, g, beta, plan: StepPlan | None = None, fit: str = "stepquant", **kw):
    """Out-of-place twin of :func:`reference.step` on gathered records ``[N, size]``."""
    plan = plan or StepPlan(layout, impact, records.device, fit)
    new = records.clone()
    idx = torch.arange(records.shape[0], dtype=torch.int32, device=records.device)
    out = step_(new, idx, plan, q, k, v, g, beta, min_slot=0, **kw)
    return out, new


__all__ = ["StepPlan", "old_row_floats", "shape_error", "step_", "step", "LAUNCH", "PIVOT", "FITS"]
