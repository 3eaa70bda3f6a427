"""Triton pieces shared by the split STEPQuant step's kernels: the record's
code packing (``format.py``), nearest levels, fp16 scale rounding and the
divisions of the exact and fast fits.

Tiles put the 4 columns of a code group first, ``[4, ., .]`` (element (a, b,
i) is column ``4 b + a`` of key row i), so the codes of a byte (of a 6-bit
24-bit word) stay in one thread and are packed and unpacked there.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp16_round(x):
    return tl.minimum(tl.maximum(x, 5.960464477539063e-08), 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def div_fast(x, d, d_inv):
    """``x / d`` correctly rounded from ``d_inv = 1 / d`` (itself correctly
    rounded): one Newton correction with exact FMA residuals (Markstein), three
    operations an element instead of a full IEEE division."""
    q = x * d_inv
    return tl.fma(tl.fma(-q, d, x), d_inv, q)


@triton.jit
def rcp(x, ASM: tl.constexpr):
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
def levels(t, BITS: tl.constexpr):
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
def signed(u, BITS: tl.constexpr):
    """Signed level (float) of unsigned codes ``u`` (int32), without an int->float conversion."""
    f = (u | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + u
    if BITS == 2:
        z = (f - 8388608.0) * 2.0 - 3.0
    else:
        z = f - (8388608.0 + ((1 << (BITS - 1)) - 1))
    return z


@triton.jit
def unpack(base, a3, i3, b3, BITS: tl.constexpr, V: tl.constexpr):
    """Unsigned codes (int32) ``[4, R, Q]`` of key rows ``i3`` and column
    quads ``b3`` of the packed head at ``base`` (uint8 pointer); for a pivot
    (BITS 16) its fp16 values. Each thread holds 4 consecutive codes of a row
    (one 6-bit word, one 2-bit byte, two 4-bit bytes) and unpacks them from its
    own bytes."""
    if BITS == 16:
        u = tl.load(base.to(tl.pointer_type(tl.float16)) + i3 * V + 4 * b3 + a3)
    elif BITS == 8:
        u = tl.load(base + i3 * V + 4 * b3 + a3).to(tl.int32)
    elif BITS == 6:  # 4 codes in the 24-bit word at byte 3 b of the row
        at = base + i3 * (3 * V // 4) + 3 * b3
        word = tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 8) | (tl.load(at + 2).to(tl.int32) << 16)
        u = (word >> (6 * a3)) & 63
    elif BITS == 4:  # the little-endian 16-bit word at byte 2 b, low nibble first
        at = base + i3 * (V // 2) + 2 * b3
        u = ((tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 8)) >> (4 * a3)) & 15
    else:  # byte b, bits 0-1 first
        u = (tl.load(base + i3 * (V // 4) + b3).to(tl.int32) >> (2 * a3)) & 3
    return u


@triton.jit
def pack_store(u, base, i3, b3, V: tl.constexpr, BITS: tl.constexpr):
    """Store unsigned codes ``u [4, X, Y]`` (int32; element (a, ., .) = column
    ``4 b + a`` of key row i, with the row and quad indices ``i3``, ``b3``
    broadcasting to ``[1, X, Y]``) packed at ``base``; the codes of one byte
    (of one 24-bit word) sit in one thread."""
    a3 = tl.arange(0, 4)[:, None, None]
    if BITS == 8:
        tl.store(base + i3 * V + 4 * b3 + a3, u.to(tl.uint8))
    else:
        word = tl.sum(u << (BITS * a3), axis=0, keep_dims=True)  # [1, X, Y]; disjoint bits: sum == or
        if BITS == 4:
            at = base + i3 * (V // 2) + 2 * b3
            tl.store(at, (word & 255).to(tl.uint8))
            tl.store(at + 1, (word >> 8).to(tl.uint8))
        elif BITS == 6:
            at = base + i3 * (3 * V // 4) + 3 * b3
            tl.store(at, (word & 255).to(tl.uint8))
            tl.store(at + 1, ((word >> 8) & 255).to(tl.uint8))
            tl.store(at + 2, ((word >> 16) & 255).to(tl.uint8))
        else:
            tl.store(base + i3 * (V // 4) + b3, word.to(tl.uint8))


@triton.jit
def row_factor(mag, w, FAST: tl.constexpr):
    """New row factor ``sqrt(mean |X| / impact)``, fp16-rounded; correctly
    rounded unless FAST."""
    if FAST:
        r = fp16_round(tl.sqrt(mag / w))
    else:
        r = fp16_round(tl.sqrt_rn(tl.math.div_rn(mag, w)))
    return r


@triton.jit
def rebuild(z, r, c, decay, FAST: tl.constexpr):
    """``S = exp(g) r c z`` from signed codes ``z``, old row factors ``r`` and
    column scales ``c`` (all broadcasting to z's shape); the reference's order
    unless FAST (decay folded into the row factors)."""
    if FAST:
        s = ((decay * r) * c) * z
    else:
        s = decay * ((r * c) * z)
    return s


@triton.jit
def head_record(pool, pool16, idx_ptr, s_idx, n, slot_stride, ALIGN: tl.constexpr):
    """(slot, uint8 and fp16 pointers to its record) of request n."""
    slot = tl.load(idx_ptr + n * s_idx).to(tl.int64)
    base = tl.multiple_of(slot * slot_stride, ALIGN)
    return slot, pool + base, pool16 + base // 2


@triton.jit
def held_updates(rec, tail_off, h, T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """A record's held updates for head ``h`` (format.py, ``tail = T``, TP
    the next power of two): (held count, fp32 pointer to d then w, fp16
    pointers to u ``[T, V]`` and k ``[T, K]``, the entry index ``[TP]``)."""
    SCALARS: tl.constexpr = (4 + 4 * T + 15) // 16 * 16  # d and w, padded
    base = rec + tail_off
    held = tl.load(base.to(tl.pointer_type(tl.int32)))
    hb = base + 16 + h * (SCALARS + 2 * T * (V + K))
    u = (hb + SCALARS).to(tl.pointer_type(tl.float16))
    return held, hb.to(tl.pointer_type(tl.float32)), u, u + T * V, tl.arange(0, TP)


@triton.jit
def held_weights(sc, kt, e, live, decay, T: tl.constexpr, K: tl.constexpr):
    """(exp(g) w_e ``[TP]``, keys k_e ``[TP, K]`` fp32) of the held entries,
    zero past them."""
    wt = tl.where(live, decay * tl.load(sc + 1 + e, mask=e < T, other=0.0), 0.0)
    keys = tl.load(kt + e[:, None] * K + tl.arange(0, K)[None, :], mask=live[:, None], other=0.0)
    return wt, keys.to(tl.float32)


@triton.jit
def held_columns(ut, e, live, col2, V: tl.constexpr):
    """The held entries' u on columns ``col2 [4, TQ]``, ``[TP, 4, TQ]`` fp32 (zero past them)."""
    return tl.load(ut + e[:, None, None] * V + col2[None, :, :], mask=live[:, None, None], other=0.0).to(tl.float32)


@triton.jit
def held_part(x, wt, keys, u3, e, T: tl.constexpr, K: tl.constexpr):
    """``x [4, TQ, K]`` plus Σ_e wt_e keys_e ⊗ u3_e: the held updates' part of
    a tile of X (entries picked by a masked sum: Triton has no indexing)."""
    for ee in tl.static_range(T):
        k_e = tl.sum(tl.where((e == ee)[:, None], keys, 0.0), axis=0)
        w_e = tl.sum(tl.where(e == ee, wt, 0.0), axis=0)
        u_e = tl.sum(tl.where((e == ee)[:, None, None], u3, 0.0), axis=0)
        x += (w_e * tl.reshape(k_e, (1, 1, K))) * u_e[:, :, None]
    return x
