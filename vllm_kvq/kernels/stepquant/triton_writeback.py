"""The split step's writeback: the fit and repack, off the layer's critical path
(twin of :func:`reference.writeback`; docs/stepquant.md, "Decode on CUDA").
One program per (value head, request) owns that head's record, so every byte
it reads from the record is its own to write; no dense state is written.

The rewrite is in place, and a value that is smaller than the program (a row
or column scale, the held decays) is loaded by threads of several warps and
stored by one of them: warps run at their own pace, so without a barrier
between the last read of old values and the first store, a late warp can read
a new scale as an old one (compiled only; Triton's interpreter runs a program
as one thread). Each ``tl.debug_barrier()`` below is that barrier.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_kvq.kernels.stepquant.triton_codes import (div_fast, fp16_round, head_record, held_columns, held_part,
                                                      held_updates, held_weights, levels, pack_store, rcp, rebuild,
                                                      row_factor, signed, unpack)


@triton.jit
def _fit_tile(z, r_old, r, c_old, decay, kk, delta, held, w, BITS: tl.constexpr, FAST: tl.constexpr,
              ROWWISE: tl.constexpr, ASM: tl.constexpr):
    """Unsigned codes ``[4, TQ, K]`` and column scales ``[4, TQ]`` of one
    tile of X = decay r_old c_old z + held + k δᵀ under the new row factors
    ``r`` (``r_old``, ``r``, ``w``: [K]; ``c_old``, ``delta``: [4, TQ, 1];
    ``kk``: [1, 1, K]; ``held``: the held updates' part, [4, TQ, K], or None)."""
    r3 = r[None, None, :]
    if FAST:  # y = X / r directly: (exp(g) r_old / r) c z + (k / r) δ, one FMA an element
        r_inv = rcp(r, ASM)[None, None, :]
        y = (((decay * r_old)[None, None, :] * r_inv) * c_old) * z + (kk * r_inv) * delta
        if held is not None:
            y += held * r_inv
    else:
        x = rebuild(z, r_old[None, None, :], c_old, decay, False)
        if held is not None:
            x += held
        x += kk * delta
        y = div_fast(x, r3, tl.math.div_rn(1.0, r3))
    if ROWWISE:  # x / r, unit column scales
        _, u = levels(y, BITS)
        c = tl.full((4, z.shape[1]), 1.0, tl.float32)
    else:
        QM: tl.constexpr = 3 if BITS == 2 else (1 << (BITS - 1)) - 1
        w3 = w[None, None, :]
        if FAST:
            # column scales by absmax, then one w²-weighted least-squares refit
            c0 = fp16_round(tl.max(tl.abs(y), axis=2) * (1.0 / QM))
            z0, _ = levels(y * rcp(c0, ASM)[:, :, None], BITS)
            # in units of y (x ~ r y): sum w² r² z0 y and sum w² r² z0², 3 ops an element instead of 5
            p = (w3 * r3) * (w3 * r3) * z0
            num = tl.sum(p * y, axis=2)
            den = tl.sum(p * z0, axis=2)
            c = tl.where(den > 0, fp16_round(num * rcp(tl.maximum(den, 1e-30), ASM)), c0)
            _, u = levels(y * rcp(c, ASM)[:, :, None], BITS)
        else:
            c0 = fp16_round(tl.math.div_rn(tl.max(tl.abs(y), axis=2), QM * 1.0))
            z0, _ = levels(div_fast(y, c0[:, :, None], tl.math.div_rn(1.0, c0)[:, :, None]), BITS)
            vals = r3 * z0
            w2 = w3 * w3
            num = tl.sum(w2 * vals * x, axis=2)
            den = tl.sum(w2 * vals * vals, axis=2)
            c = tl.where(den > 0, fp16_round(tl.math.div_rn(num, tl.maximum(den, 1e-30))), c0)
            _, u = levels(div_fast(y, c[:, :, None], tl.math.div_rn(1.0, c)[:, :, None]), BITS)
    return u, c


@triton.jit
def writeback_kernel(
    pool, pool16, slots_ptr, slot_stride, min_slot,
    heads_ptr, codes_ptr, rows_ptr, cols_ptr, w_ptr,
    delta_ptr, part_ptr, keys_ptr, decay_ptr, held_ptr, tail_off, H, QK_GROUP,
    BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TILE: tl.constexpr, PART: tl.constexpr,
    FAST: tl.constexpr, ALIGN: tl.constexpr, ROWWISE: tl.constexpr, ASM: tl.constexpr,
    T: tl.constexpr, TP: tl.constexpr,
):
    """Program (j, n): head ``heads[j]`` of request n, the whole head. With
    held updates (T > 0) a record holding fewer than T appends this step's
    instead (its count, read by the foreground, comes from the scratch: the
    program of head 0 rewrites it in the record)."""
    j = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    slot, rec, rec16 = head_record(pool, pool16, slots_ptr, 1, n, slot_stride, ALIGN)
    if slot >= min_slot:
        TQ: tl.constexpr = TILE // 4
        PG: tl.constexpr = V // PART
        h = tl.load(heads_ptr + j)
        scratch = n * H + h
        rows = tl.arange(0, K)
        a3 = tl.arange(0, 4)[:, None, None]
        i3 = rows[None, None, :]
        decay = tl.load(decay_ptr + scratch)
        kk = tl.load(keys_ptr + (n * (H // QK_GROUP) + h // QK_GROUP) * K + rows)[None, None, :]
        co = tl.multiple_of(tl.load(codes_ptr + j), ALIGN)
        due = True
        decay_x = decay  # the codes' decay: exp(g) d with held updates
        ut, wt, keys_t, e, live = rec16, 0.0, 0.0, 0, False  # (no held updates)
        if T > 0:
            _, sc, ut, kt, e = held_updates(rec, tail_off, h, T, TP, K, V)
            held = tl.load(held_ptr + n)
            live = (e < held) & (e < T)
            d_old = tl.load(sc)
            decay_x = decay * d_old
            wt, keys_t = held_weights(sc, kt, e, live, decay, T, K)
            due = held >= T
            tl.debug_barrier()  # every warp has read d and w before they are rewritten (see the module's note)
            if held < T:  # append: d and w decay, entry `held` is (k, δ) with w = 1
                tl.store(sc, d_old * decay)
                tl.store(sc + 1 + e, tl.where(e == held, 1.0, wt), mask=e < T)
                cols = tl.arange(0, V)
                tl.store(ut + held * V + cols, tl.load(delta_ptr + scratch * V + cols).to(tl.float16))
                tl.store(kt + held * K + rows, tl.reshape(kk, (K,)).to(tl.float16))
                if h == 0:
                    tl.store((rec + tail_off).to(tl.pointer_type(tl.int32)), held + 1)
            else:  # fitted now: nothing held, d = 1
                tl.store(sc, 1.0)
                if h == 0:
                    tl.store((rec + tail_off).to(tl.pointer_type(tl.int32)), 0)
        if due:
            if BITS == 16:
                for t in range(V // TILE):
                    quads = t * TQ + tl.arange(0, TQ)
                    b3 = quads[None, :, None]
                    col2 = 4 * quads[None, :] + tl.arange(0, 4)[:, None]
                    delta = tl.load(delta_ptr + scratch * V + col2)[:, :, None]
                    at = rec16 + co // 2 + i3 * V + 4 * b3 + a3
                    x = decay_x * tl.load(at).to(tl.float32)
                    if T > 0:
                        x = held_part(x, wt, keys_t, held_columns(ut, e, live, col2, V), e, T, K)
                    tl.store(at, (x + kk * delta).to(tl.float16))
            else:
                # every row factor first: the old ones kept in registers, the new ones stored
                G: tl.constexpr = V // 32 if BITS == 2 else 1
                gi = tl.arange(0, G)[:, None]
                at_r = rec16 + tl.multiple_of(tl.load(rows_ptr + j), ALIGN) // 2 + rows[None, :] * G + gi  # [G, K]
                r_old_all = tl.load(at_r).to(tl.float32)
                w = tl.load(w_ptr + h * K + rows)
                if BITS == 2:  # PART is 32 in layers with INT2 heads: partial g is group g
                    mag = tl.load(part_ptr + (scratch * PG + gi) * K + rows[None, :]) * (1.0 / 32)
                else:
                    part = tl.load(part_ptr + (scratch * PG + tl.arange(0, PG)[:, None]) * K + rows[None, :])
                    if ROWWISE:
                        mag = tl.max(part, axis=0)[None, :]
                    else:
                        mag = tl.sum(part, axis=0)[None, :] * (1.0 / V)
                if ROWWISE:  # r_i = max_j |X_ij| / qmax
                    QMR: tl.constexpr = (1 << (BITS - 1)) - 1
                    r_new_all = fp16_round(tl.math.div_rn(mag, QMR * 1.0))
                else:
                    r_new_all = row_factor(tl.maximum(mag, 1e-20), w[None, :], FAST)
                tl.debug_barrier()
                tl.store(at_r, r_new_all.to(tl.float16))
                cp = rec16 + tl.multiple_of(tl.load(cols_ptr + j), ALIGN) // 2
                for t in range(V // TILE):
                    quads = t * TQ + tl.arange(0, TQ)
                    b3 = quads[None, :, None]
                    col2 = 4 * quads[None, :] + tl.arange(0, 4)[:, None]
                    if BITS == 2:  # the tile lies in one 32-column group
                        sel = gi == (t * TILE) // 32
                        r_old = tl.sum(tl.where(sel, r_old_all, 0.0), axis=0)
                        r = tl.sum(tl.where(sel, r_new_all, 0.0), axis=0)
                    else:
                        r_old = tl.reshape(r_old_all, (K,))
                        r = tl.reshape(r_new_all, (K,))
                    z = signed(unpack(rec + co, a3, i3, b3, BITS, V), BITS)
                    c_old = tl.load(cp + col2).to(tl.float32)[:, :, None]
                    delta = tl.load(delta_ptr + scratch * V + col2)[:, :, None]
                    held_x = None
                    if T > 0:
                        held_x = held_part(tl.zeros((4, TQ, K), tl.float32), wt, keys_t,
                                           held_columns(ut, e, live, col2, V), e, T, K)
                    u, c = _fit_tile(z, r_old, r, c_old, decay_x, kk, delta, held_x, w, BITS, FAST, ROWWISE, ASM)
                    tl.debug_barrier()
                    pack_store(u, rec + co, i3, b3, V, BITS)
                    tl.store(cp + col2, c.to(tl.float16))
