"""The split step's foreground: what a GDN layer waits for (twin of
:func:`reference.foreground`; docs/stepquant.md, "Decode on CUDA"). One
program per (``TILE`` value columns, value head, request), all K key rows.
The record is only read; δ, the rows' partial sums of |X| (max for the
rowwise fit), and the request's slot, key and decay go to the scratch, since
the step's own inputs are temporaries the writeback must not race.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_kvq.kernels.stepquant.triton_codes import (head_record, held_columns, held_part, held_updates, held_weights,
                                                      rcp, rebuild, signed, unpack)


@triton.jit
def _store_parts(ax, at, NP: tl.constexpr, PART: tl.constexpr, K: tl.constexpr, ROWWISE: tl.constexpr):
    """Row partials of ``ax [4, TQ, K]`` (|X| of a tile, or its running sum
    or max) over each PART columns, ``[NP, K]`` at ``at``: reduced first
    within a thread (the 4 columns of a quad), then across threads."""
    part = tl.reshape(ax, (4, NP, PART // 4, K))
    if ROWWISE:
        part = tl.max(tl.max(part, axis=0), axis=1)
    else:
        part = tl.sum(tl.sum(part, axis=0), axis=1)
    tl.store(at + tl.arange(0, NP)[:, None] * K + tl.arange(0, K)[None, :], part)


@triton.jit
def foreground_kernel(
    pool, pool16, idx_ptr, s_idx, slot_stride, min_slot,
    heads_ptr, codes_ptr, rows_ptr, cols_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, out_ptr,
    slots_ptr, delta_ptr, part_ptr, keys_ptr, decay_ptr, held_ptr, tail_off,
    sqn, sqh, skn, skh, svn, svh, sgn, sgh, sbn, sbh, H, QK_GROUP,
    BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
    PART: tl.constexpr, FAST: tl.constexpr, ALIGN: tl.constexpr, ROWWISE: tl.constexpr, ASM: tl.constexpr,
    RAW: tl.constexpr, T: tl.constexpr, TP: tl.constexpr,
):
    """Program (p, j, n): ``TILES`` tiles of ``TILE`` value columns, from
    column ``p * TILES * TILE``, of head ``heads[j]`` of request n. With RAW,
    q, k are vLLM's post-conv rows and g, beta its gate inputs a, b: they are
    normalised and gated here as vLLM's decode kernel does it. With held
    updates (T > 0) the state is ``d X̂ + Σ w_e k_e u_eᵀ`` (format.py); the
    row partials are only needed, and only written, when the record is due
    for its fit (T updates held)."""
    p = tl.program_id(0)
    j = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    TQ: tl.constexpr = TILE // 4
    NP: tl.constexpr = TILE // PART
    PG: tl.constexpr = V // PART
    h = tl.load(heads_ptr + j)
    scratch = n * H + h
    slot, rec, rec16 = head_record(pool, pool16, idx_ptr, s_idx, n, slot_stride, ALIGN)
    if (p == 0) & (j == 0):
        tl.store(slots_ptr + n, slot.to(tl.int32))
    if slot < min_slot:
        for tt in range(TILES):
            col2 = (p * TILES + tt) * TILE + 4 * tl.arange(0, TQ)[None, :] + tl.arange(0, 4)[:, None]
            tl.store(out_ptr + scratch * V + col2, tl.zeros((4, TQ), tl.float32))
    else:
        a3 = tl.arange(0, 4)[:, None, None]
        i3 = tl.arange(0, K)[None, None, :]  # tiles [4, TQ, K]: key rows last (each thread holds several)
        kh = h // QK_GROUP
        k3 = tl.load(k_ptr + n * skn + kh * skh + i3).to(tl.float32)
        q3 = tl.load(q_ptr + n * sqn + kh * sqh + i3).to(tl.float32)
        g = tl.load(g_ptr + n * sgn + h * sgh).to(tl.float32)
        beta = tl.load(beta_ptr + n * sbn + h * sbh).to(tl.float32)
        if RAW:  # L2-normed q and k (q times K^-1/2), g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
            k3 = k3 / tl.sqrt(tl.sum(k3 * k3, axis=2, keep_dims=True) + 1e-6)
            q3 = q3 / tl.sqrt(tl.sum(q3 * q3, axis=2, keep_dims=True) + 1e-6) * (1.0 / tl.sqrt(K * 1.0))
            g = g + tl.load(dtb_ptr + h).to(tl.float32)
            g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
            beta = tl.sigmoid(beta)
        decay = tl.exp(g)
        kq = tl.sum(k3 * q3, axis=2)
        # decay_x: the codes' decay (d exp(g) with held updates); a_k, a_q [TP]: each held update's weight in
        # Sᵀk and Sᵀq (exp(g) w_e (k_e·k), (k_e·q)); due: the partials are wanted
        decay_x = decay
        due = True
        if T > 0:
            held, sc, ut, kt, e = held_updates(rec, tail_off, h, T, TP, K, V)
            live = (e < held) & (e < T)
            due = held >= T
            decay_x = decay * tl.load(sc)
            wt, keys_t = held_weights(sc, kt, e, live, decay, T, K)
            a_k = wt * tl.sum(keys_t * tl.reshape(k3, (1, K)), axis=1)
            a_q = wt * tl.sum(keys_t * tl.reshape(q3, (1, K)), axis=1)
            if (p == 0) & (j == 0):
                tl.store(held_ptr + n, held)
        co = tl.multiple_of(tl.load(codes_ptr + j), ALIGN)
        ro = tl.multiple_of(tl.load(rows_ptr + j), ALIGN)
        cp = rec16 + tl.multiple_of(tl.load(cols_ptr + j), ALIGN) // 2
        if BITS == 16:  # a pivot: z its fp16 values, r = c = 1
            r = tl.full((1, 1, K), 1.0, tl.float32)
        else:
            r = tl.load(rec16 + ro // 2 + i3 * (V // 32 if BITS == 2 else 1)).to(tl.float32)
        # the fast form's row scale exp(g) r, floored at 2^-40 (a fresh record's r is 0), and k over it
        d_fl = tl.maximum(decay_x * r, 9.094947017729282e-13) if FAST else tl.full((1, 1, K), 1.0, tl.float32)
        k_fl = k3 * rcp(d_fl, ASM)
        # heads other than INT2 sum their rows across the program's tiles in registers and reduce once
        ACC: tl.constexpr = BITS != 2 and TILES > 1 and (TILE * TILES) % PART == 0
        acc = tl.zeros((4, TQ, K), tl.float32)
        for tt in range(TILES):
            t = p * TILES + tt
            quads = t * TQ + tl.arange(0, TQ)
            col2 = 4 * quads[None, :] + tl.arange(0, 4)[:, None]  # [4, TQ] column index
            b3 = quads[None, :, None]
            if BITS == 2:  # one row factor per 32 columns
                if TILE <= 32:  # the tile lies in one group
                    r = tl.load(rec16 + ro // 2 + i3 * (V // 32) + (t * TILE) // 32).to(tl.float32)
                else:
                    r = tl.load(rec16 + ro // 2 + i3 * (V // 32) + b3 // 8).to(tl.float32)
                if FAST:
                    d_fl = tl.maximum(decay_x * r, 9.094947017729282e-13)
                    k_fl = k3 * rcp(d_fl, ASM)
            if BITS == 16:
                z = unpack(rec + co, a3, i3, b3, BITS, V).to(tl.float32)
                c = tl.full((4, TQ), 1.0, tl.float32)
            else:
                z = signed(unpack(rec + co, a3, i3, b3, BITS, V), BITS)
                c = tl.load(cp + col2).to(tl.float32)
            vv = tl.load(v_ptr + n * svn + h * svh + col2).to(tl.float32)
            if T > 0:  # the held updates' rows u_e of these columns, [TP, 4, TQ]
                u3 = held_columns(ut, e, live, col2, V)
            if FAST:
                # S = dr c z (+ held) with dr = exp(g) d r: Sᵀk = c Σ_i z (dr k), one FMA an element per sum;
                # Xᵀq = Sᵀq + (k·q) δ
                dr = decay_x * r
                s_k = c * tl.sum(z * (dr * k3), axis=2)
                if T > 0:
                    s_k += tl.sum(a_k[:, None, None] * u3, axis=0)
                delta = beta * (vv - s_k)
                s_q = c * tl.sum(z * (dr * q3), axis=2)
                if T > 0:
                    s_q += tl.sum(a_q[:, None, None] * u3, axis=0)
                tl.store(out_ptr + scratch * V + col2, s_q + kq * delta)
            else:  # the reference's operations
                s = rebuild(z, r, c[:, :, None], decay_x, False)
                if T > 0:
                    s = held_part(s, wt, keys_t, u3, e, T, K)
                delta = beta * (vv - tl.sum(s * k3, axis=2))
                x = s + k3 * delta[:, :, None]
                tl.store(out_ptr + scratch * V + col2, tl.sum(x * q3, axis=2))
            if due:
                if FAST:
                    # |X| = dr c |z + (k / dr)(δ / c) + Σ_e (exp(g) w_e k_e / dr)(u_e / c)|: two FMAs an
                    # element (two more a held update), dr applied to the row sums; dr and c floored at 2^-40
                    # (a fresh record's are 0), which moves X by at most 2^-80 |z|
                    c_fl = tl.maximum(c, 9.094947017729282e-13)
                    c_inv = rcp(c_fl, ASM)
                    y = z + k_fl * (delta * c_inv)[:, :, None]
                    if T > 0:
                        y = held_part(y, wt, keys_t * rcp(tl.reshape(d_fl, (1, K)), ASM), u3 * c_inv[None, :, :],
                                      e, T, K)
                    ax = tl.abs(y) * c_fl[:, :, None]
                else:
                    ax = tl.abs(x)
                if ACC:
                    acc = tl.maximum(acc, ax) if ROWWISE else acc + ax
                else:
                    _store_parts(ax * d_fl, part_ptr + (scratch * PG + t * NP) * K, NP, PART, K, ROWWISE)
            tl.store(delta_ptr + scratch * V + col2, delta)
        if ACC:
            if due:  # into the program's first slot; its others (when the layer keeps sums per 32 columns) zeroed
                NPP: tl.constexpr = TILE * TILES // PART
                _store_parts(acc * d_fl, part_ptr + (scratch * PG + p * NPP) * K, 1, TILE, K, ROWWISE)
                if NPP > 1:
                    slots = tl.arange(0, NPP)[:, None]
                    tl.store(part_ptr + (scratch * PG + p * NPP + slots) * K + tl.arange(0, K)[None, :],
                             tl.zeros((NPP, K), tl.float32), mask=slots > 0)
        if p == 0:
            tl.store(decay_ptr + scratch, decay)
            if h % QK_GROUP == 0:
                tl.store(keys_ptr + (n * (H // QK_GROUP) + kh) * K + i3, k3)
