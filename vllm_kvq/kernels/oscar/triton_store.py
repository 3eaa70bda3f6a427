"""Fused OSCAR write path: rotate K, clip, quantize, pack, and store BF16
sink/window rows, in one launch per layer.

Twin of :func:`reference.write_request` (plus the K rotation and the
quantizer of :func:`reference.quantize_rows`) for every token of a batch at
once; the pages it writes equal the reference's bit for bit. A program takes
``T`` rows (tokens) of one KV head, each row sliced over ``TPR`` threads that
hold its 16-byte pieces ``h, h + TPR, ...`` of K and of V (so a row's clip
search, min/max and packing stay within a few lanes instead of spreading over
a warp):

* **clip threshold**: the bf16 magnitude pattern ``c`` with more than ``A``
  entries at or above it (``sort(|x|)[D - 1 - A]``), found bit by bit. K and V
  share the two 16-bit halves of one int32 with a guard bit above each
  magnitude, so ``(|x| | 0x8000) - c`` keeps bit 15 of a half iff ``|x| >= c``;
  one byte permute (PRMT, sign-replicating) turns two such words into 0xFF
  flags in four byte counters, and the row's sum times 255^-1 mod 2^32 gives
  the counts. The search starts in the octave below the row's largest
  magnitude (7 bits) and falls back to all 15 bits in a tile where a row's
  threshold lies lower.
* **codes**: ``clamp(floor((x - min) / scale + 0.5), 0, 3)`` with the division
  correctly rounded from one reciprocal per row (``q0 = a r``, refined by one
  residual: Markstein), counted against the three points where the rounding
  steps (``q >= 0.5 - 2^-25, 1.5, 2.5``) and added into the packed word.

A token at position -1 (its request has length 0: the padding vLLM adds to a
batch replayed from a CUDA graph) or with a negative slot writes nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.oscar.format import OscarFormat

# warps, and threads per row (tpr): the program takes 32 * num_warps / tpr rows
LAUNCH = {"num_warps": 4, "tpr": 4}


def default_launch(head_size: int, decode: bool = False) -> dict:
    """The launch for ``head_size``: ``tpr`` grows with the head so a thread
    keeps 32 elements of a K row and 32 of the V row, or 16 of each for a
    decode step, whose few tokens fill more programs of 16 rows (the least the
    tensor-core rotation takes) instead (on the H200, 0.0092 against 0.011 ms
    per graph replay at batch 8, 0.0103 against 0.013 at batch 256)."""
    return {**LAUNCH, "tpr": max(head_size // (16 if decode else 32), 2)}


def _compiled(x: torch.Tensor) -> bool:
    """True where Triton compiles for a GPU (not in its interpreter)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


@triton.jit
def _flags(dl, dh, ASM: tl.constexpr):
    """0xFF in byte 0/1/2/3 where bit 15 of dl / bit 15 of dh / bit 31 of dl /
    bit 31 of dh is set (255 times the 0/1 flags)."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0xFBD9;", "=r,r,r", [dl, dh],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return (((dl >> 15) & 0x10001) | ((dh >> 7) & 0x1000100)) * 255


@triton.jit
def _counts(pl, ph, cand, ASM: tl.constexpr):
    """Per row: entries of K and of V whose magnitude is >= the row's
    candidate (K in the low, V in the high 16 bits of ``cand [T]``)."""
    c = cand[None, None, :, None, None]
    w = _flags(pl - c, ph - c, ASM)
    s = tl.sum(tl.sum(tl.sum(tl.sum(w, axis=4), axis=1), axis=0), axis=1)  # in-thread axes first
    f = s * -16843009
    return (f & 0xFF) + ((f >> 8) & 0xFF), ((f >> 16) & 0xFF) + ((f >> 24) & 0xFF)


@triton.jit
def _clip_thresholds(pl, ph, mk, mv, k_above, v_above, ASM: tl.constexpr):
    """bf16 magnitude patterns of each row's clip threshold, K and V: the
    largest c with more than ``*_above`` entries >= c (sort(|x|)[D-1-above])."""
    lk = tl.maximum(mk - 127, 0)
    lv = tl.maximum(mv - 127, 0)
    nk, nv = _counts(pl, ph, lk | (lv << 16), ASM)
    fast_k = nk > k_above
    fast_v = nv > v_above
    base = tl.where(fast_k, lk, 0) | (tl.where(fast_v, lv, 0) << 16)
    mask = tl.where(fast_k, 0x7F, 0x7FFF) | (tl.where(fast_v, 0x7F, 0x7FFF) << 16)
    slow = tl.max(tl.where(fast_k & fast_v, 0, 1), axis=0)
    nbits = 7 + 8 * slow
    o = tl.zeros_like(base)
    for i in range(nbits):
        bit = (1 << (nbits - 1)) >> i
        b = (bit | (bit << 16)) & mask
        nk, nv = _counts(pl, ph, base + (o | b), ASM)
        take = tl.where(nk > k_above, 0xFFFF, 0) | tl.where(nv > v_above, -65536, 0)
        o = o | (b & take)
    t = base + o
    return t & 0xFFFF, (t >> 16) & 0xFFFF


@triton.jit
def _clamp_pairs(words, thr2, ASM: tl.constexpr):
    """bf16 pairs clamped to [-thr, thr] lane by lane (``thr2``: the bf16
    threshold in both 16-bit lanes); exact, so the same in either form."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 n; xor.b32 n, $2, 0x80008000; max.bf16x2 $0, $1, n; min.bf16x2 $0, $0, $2; }",
            "=r,r,r", [words, thr2], dtype=tl.int32, is_pure=True, pack=1)
    t = (thr2 << 16).to(tl.float32, bitcast=True)
    lo = tl.minimum(tl.maximum((words << 16).to(tl.float32, bitcast=True), -t), t)
    hi = tl.minimum(tl.maximum((words & -65536).to(tl.float32, bitcast=True), -t), t)
    return ((lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (hi.to(tl.int32, bitcast=True) & -65536)


@triton.jit
def _ge(q, h, ASM: tl.constexpr):
    """-1 where q >= h, else 0 (one SET instruction compiled)."""
    if ASM:
        return tl.inline_asm_elementwise("set.ge.u32.f32 $0, $1, $2;", "=r,r,r", [q, h],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return -(q >= h).to(tl.int32)


@triton.jit
def _codes(x, a_lo, neg_s, r, spos, mult, ASM: tl.constexpr):
    """INT2 codes of fp32 ``x`` (clipped bf16 values) times ``mult`` (their bit
    in the packed word): the reference's clamp(floor((x - lo) / s + 0.5), 0, 3)
    with the division correctly rounded (one reciprocal per row; q0 = a r
    refined by one residual, Markstein), counted against the three points where
    floor(q + 0.5) steps: q >= 0.5 - 2^-25, 1.5, 2.5."""
    a = x - a_lo
    q0 = a * r
    rem = tl.fma(q0, neg_s, a)
    q = tl.where(spos, tl.fma(rem, r, q0), q0)
    n = _ge(q, 0.4999999701976776, ASM) + _ge(q, 1.5, ASM) + _ge(q, 2.5, ASM)
    return n * mult


@triton.jit
def _row_quant(words, tmin, tmax, thr, NG: tl.constexpr, PG: tl.constexpr, T: tl.constexpr,
               TPR: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """Packed code words [T, D/16] and (scale | min << 16) words [NG, T] of
    the rows in ``words [NG, PG, T, TPR, 4]`` (bf16 pairs) clipped at ``thr``
    (bf16 magnitude patterns [T])."""
    thr_f = (thr << 16).to(tl.float32, bitcast=True)
    lo = tl.maximum(tmin, -thr_f[None, :])
    hi = tl.minimum(tmax, thr_f[None, :])
    scale = tl.maximum(tl.math.div_rn(hi - lo, 3.0), 1e-8).to(tl.float16)
    lo16 = lo.to(tl.float16)
    s = scale.to(tl.float32)
    r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    pair = ((scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
            | (lo16.to(tl.int16, bitcast=True).to(tl.int32) << 16))
    # element d = 8 pi + 2 w + e of piece pi = (g PG + p) TPR + h goes to byte
    # d % (D/4), bits 2 (d // (D/4)), of the row's packed codes
    NQ: tl.constexpr = D // 32  # pieces per quarter
    word = _word_in_row(NG, PG, TPR)
    w_i = word % 4
    quarter = (word // 4) // NQ
    # -1 per step passed, so the bit's negative
    m_lo = -(1 << (8 * ((2 * w_i) % 4) + 2 * quarter))
    m_hi = m_lo * 256
    clipped = _clamp_pairs(words, (thr | (thr << 16))[None, None, :, None, None], ASM)
    xl = (clipped << 16).to(tl.float32, bitcast=True)
    xh = (clipped & -65536).to(tl.float32, bitcast=True)
    l5 = lo16.to(tl.float32)[:, None, :, None, None]
    s5 = -s[:, None, :, None, None]
    r5 = r[:, None, :, None, None]
    p5 = (s > 0)[:, None, :, None, None]
    c = _codes(xl, l5, s5, r5, p5, m_lo, ASM) + _codes(xh, l5, s5, r5, p5, m_hi, ASM)  # [NG, PG, T, TPR, 4]
    c = tl.sum(tl.reshape(c, (NG, PG, T, TPR, 2, 2)), axis=5)  # words of 4 bytes, one quarter each
    c = tl.permute(c, (2, 0, 1, 3, 4))  # [T, NG, PG, TPR, 2]
    c = tl.reshape(c, (T, 4, NQ, 2))  # pieces -> (quarter, piece within the quarter)
    return tl.reshape(tl.sum(c, axis=1), (T, 2 * NQ)), pair


@triton.jit
def _word_in_row(NG: tl.constexpr, PG: tl.constexpr, TPR: tl.constexpr):
    """Index of each int32 word of ``[NG, PG, T, TPR, 4]`` row slices in its row."""
    g_i = tl.arange(0, NG)[:, None, None, None, None]
    p_i = tl.arange(0, PG)[None, :, None, None, None]
    h_i = tl.arange(0, TPR)[None, None, None, :, None]
    w_i = tl.arange(0, 4)[None, None, None, None, :]
    return ((g_i * PG + p_i) * TPR + h_i) * 4 + w_i


@triton.jit
def _minmax(words, NG: tl.constexpr):
    """Per group (scale region) and row: fp32 min and max of the bf16 pairs."""
    xl = (words << 16).to(tl.float32, bitcast=True)
    xh = (words & -65536).to(tl.float32, bitcast=True)
    mn = tl.min(tl.min(tl.min(tl.minimum(xl, xh), axis=4), axis=1), axis=2)
    mx = tl.max(tl.max(tl.max(tl.maximum(xl, xh), axis=4), axis=1), axis=2)
    return mn, mx  # [NG, T]


@triton.jit
def _store_kernel(
    k_ptr, v_ptr, rot_ptr, k_out_ptr,
    pos_ptr, req_ptr, end_ptr, slot_ptr, bt_ptr, bt_stride,
    cache_u8,
    n_tokens, k_clip_above, v_clip_above,
    stride_kt, stride_kh, stride_vt, stride_vh,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr, STATE_BLOCKS: tl.constexpr, ROWS: tl.constexpr,
    ROTATE: tl.constexpr, ROT_PARTS: tl.constexpr, DATA: tl.constexpr, STATE: tl.constexpr,
    T: tl.constexpr, TPR: tl.constexpr, ASM: tl.constexpr, DECODE: tl.constexpr, SLOTS: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    NG: tl.constexpr = D // G
    D4: tl.constexpr = D // 4
    PIECES: tl.constexpr = D // (8 * TPR)  # 16-byte pieces of a row per thread
    PG: tl.constexpr = PIECES // NG
    BLOCK_BYTES: tl.constexpr = KB * (D // 2 + 8 * NG)

    if ROTATE:
        # k @ R (R as ROT_PARTS bf16 parts summing to it: fp32-accurate on bf16
        # keys), in slices of RC input dims; rounded to bf16 into k_out, which the
        # rows below then read back in their own layout
        RC: tl.constexpr = 32
        rt = pid_t * T + tl.arange(0, T)
        rc = tl.arange(0, RC)
        cols = tl.arange(0, D)
        rok = (rt < n_tokens)[:, None]
        acc = tl.zeros([T, D], tl.float32)
        for c in tl.static_range(D // RC):
            kc = tl.load(k_ptr + rt[:, None] * stride_kt + h * stride_kh + c * RC + rc[None, :], mask=rok, other=0.0)
            for part in tl.static_range(ROT_PARTS):
                r = tl.load(rot_ptr + ((part * H + h) * D + c * RC + rc)[:, None] * D + cols[None, :])
                if ASM:
                    acc = tl.dot(kc, r, acc)
                else:  # Triton's interpreter multiplies bf16 operands wrongly
                    acc = tl.dot(kc.to(tl.float32), r.to(tl.float32), acc, input_precision="ieee")
        tl.store(k_out_ptr + rt[:, None] * (H * D) + h * D + cols[None, :], acc.to(tl.bfloat16), mask=rok)
        tl.debug_barrier()
        k_src = k_out_ptr
        skt = H * D
        skh = D
    else:
        k_src = k_ptr
        skt = stride_kt
        skh = stride_kh

    # rows sliced over TPR threads: thread (t, hh) holds 16-byte pieces hh, hh + TPR, ...
    F: tl.constexpr = PIECES * T * TPR
    f = tl.arange(0, F)
    fp = f // (T * TPR)
    ft = (f // TPR) % T
    fh = f % TPR
    ftok = pid_t * T + ft
    fok = (ftok < n_tokens)[:, None]
    wcol = ((fp * TPR + fh) * 4)[:, None] + tl.arange(0, 4)[None, :]  # int32 word in the row
    kw = tl.load(k_src.to(tl.pointer_type(tl.int32)) + (ftok * (skt // 2) + h * (skh // 2))[:, None] + wcol,
                 mask=fok, other=0)
    vw = tl.load(v_ptr.to(tl.pointer_type(tl.int32)) + (ftok * (stride_vt // 2) + h * (stride_vh // 2))[:, None]
                 + wcol, mask=fok, other=0)
    kw = tl.reshape(kw, (NG, PG, T, TPR, 4))
    vw = tl.reshape(vw, (NG, PG, T, TPR, 4))

    tok = pid_t * T + tl.arange(0, T)
    tok_ok = tok < n_tokens
    if DECODE:
        req = tok
        end = tl.load(end_ptr + tok, mask=tok_ok, other=0)
        pos = end - 1
    else:
        pos = tl.load(pos_ptr + tok, mask=tok_ok, other=-1)
        req = tl.load(req_ptr + tok, mask=tok_ok, other=0)
        end = tl.load(end_ptr + tok, mask=tok_ok, other=0)
    live = tok_ok & (pos >= 0)
    if SLOTS:
        live = live & (tl.load(slot_ptr + tok, mask=tok_ok, other=-1) >= 0)
    row = bt_ptr + req.to(tl.int64) * bt_stride

    if DATA:
        kmn, kmx = _minmax(kw, NG)
        vmn, vmx = _minmax(vw, NG)
        mk = (tl.maximum(tl.max(kmx, axis=0), -tl.min(kmn, axis=0)).to(tl.int32, bitcast=True) >> 16) & 0x7FFF
        mv = (tl.maximum(tl.max(vmx, axis=0), -tl.min(vmn, axis=0)).to(tl.int32, bitcast=True) >> 16) & 0x7FFF
        tk = mk
        tv = mv
        if (k_clip_above >= 0) | (v_clip_above >= 0):
            # magnitudes of K and V side by side, a guard bit above each (sign bits dropped)
            pl = (kw & 0xFFFF) | (vw << 16) | -2147450880  # | 0x80008000
            ph = ((kw >> 16) & 0xFFFF) | (vw & -65536) | -2147450880
            tk, tv = _clip_thresholds(pl, ph, mk, mv, k_clip_above, v_clip_above, ASM)
        kc, ksm = _row_quant(kw, kmn, kmx, tk, NG, PG, T, TPR, D, ASM)
        vc, vsm = _row_quant(vw, vmn, vmx, tv, NG, PG, T, TPR, D, ASM)

        blk = tl.load(row + STATE_BLOCKS + pos // KB, mask=live, other=0).to(tl.int64)
        off = pos % KB
        base = (blk * H + h) * BLOCK_BYTES
        NW: tl.constexpr = D // 16  # code words of a row
        wi = tl.arange(0, NW)
        kcode = (cache_u8 + base + off * D4).to(tl.pointer_type(tl.int32))
        tl.store(kcode[:, None] + wi[None, :], kc, mask=live[:, None])
        vb = tl.reshape((vc[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF, (T, D4)).to(tl.uint8)
        tl.store(cache_u8 + (base + KB * D4 + off)[:, None] + tl.arange(0, D4)[None, :] * KB, vb,
                 mask=live[:, None])
        gi = tl.arange(0, NG)[:, None]
        sm = (cache_u8 + base + KB * (D // 2) + off * 4 * NG).to(tl.pointer_type(tl.int32))
        tl.store(sm[None, :] + gi, ksm, mask=live[None, :])
        tl.store(sm[None, :] + KB * NG + gi, vsm, mask=live[None, :])

    if STATE:  # BF16 rows of the sink and of the last W positions of this chunk
        keep = live & ((pos < SINK) | (pos >= tl.maximum(end - WINDOW, SINK)))
        slot = tl.where(pos < SINK, pos, SINK + (pos - SINK) % RING)
        sblk = tl.load(row + slot // ROWS, mask=keep, other=0).to(tl.int64)
        sbase = (sblk * H + h) * BLOCK_BYTES + (slot % ROWS) * (4 * D)
        srow = (cache_u8 + sbase).to(tl.pointer_type(tl.int32))[None, None, :, None, None] + _word_in_row(NG, PG, TPR)
        k5 = keep[None, None, :, None, None]
        tl.store(srow, kw, mask=k5)
        tl.store(srow + D // 2, vw, mask=k5)


def entries_above_clip(ratio: float, d: int) -> int:
    """How many entries of a row lie above the order statistic that
    :func:`reference.clip_rows` clamps at (-1: no clip)."""
    return -1 if ratio >= 1.0 else d - 1 - min(int(ratio * d), d - 1)


def rotation_parts(rotation: torch.Tensor, parts: int = 3) -> torch.Tensor:
    """``[H, D, D]`` rotation as the ``[parts, H, D, D]`` bf16 matrices that
    sum to it, each the bf16 rounding of what the earlier ones leave: three
    carry fp32's 24 bits, so the store's bf16 tensor-core products of bf16 keys
    with them are fp32-accurate. Made once per layer; the store takes these."""
    rest = rotation.to(torch.float32)
    out = []
    for _ in range(parts):
        out.append(rest.to(torch.bfloat16))
        rest = rest - out[-1].float()
    return torch.stack(out).contiguous()


def store_tokens(
    kv_cache: torch.Tensor,
    fmt: OscarFormat,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rotation: torch.Tensor | None,
    positions: torch.Tensor,
    request: torch.Tensor,
    seq_end: torch.Tensor,
    block_table: torch.Tensor,
    k_clip: float,
    v_clip: float,
    data: bool = True,
    state: bool = True,
    launch: dict | None = None,
) -> torch.Tensor:
    """Rotate ``k`` (``[N, H, D]``, unrotated) by ``k_rotation`` (the
    :func:`rotation_parts` of R_K, or None) and store ``k, v`` of every token in
    the paged cache.

    Per token: its ``positions``, ``request`` (row of ``block_table``) and
    ``seq_end`` (that request's length after this step). Returns the rotated
    keys in bf16 ``[N, H, D]`` (``k`` itself when there is no rotation).

    ``data``/``state`` select the INT2 rows and the BF16 sink/window rows;
    ``launch``: ``{"num_warps", "tpr"}`` over :func:`default_launch`. A
    multi-token chunk stores its INT2 rows, attends, then stores its BF16 rows:
    its early queries still need the ring rows its later tokens overwrite.
    """
    return _launch(kv_cache, fmt, k, v, k_rotation, positions, request, seq_end, None, block_table,
                   k_clip, v_clip, data, state, launch)


def store_decode_tokens(
    kv_cache: torch.Tensor,
    fmt: OscarFormat,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rotation: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    k_clip: float,
    v_clip: float,
    slot_mapping: torch.Tensor | None = None,
    launch: dict | None = None,
) -> torch.Tensor:
    """:func:`store_tokens` for a batch of single-token requests: token ``i``
    is request ``i``'s, at position ``seq_lens[i] - 1``.

    Reads nothing but device tensors (no per-step index), so a CUDA graph that
    captured it replays any batch written into the same ``seq_lens``,
    ``block_table`` and ``slot_mapping`` buffers. Tokens of length-0 requests
    and, with ``slot_mapping``, tokens whose slot is negative (vLLM's padding
    and dummy batches) write nothing.
    """
    return _launch(kv_cache, fmt, k, v, k_rotation, None, None, seq_lens, slot_mapping, block_table,
                   k_clip, v_clip, True, True, launch)


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as bf16 rows the kernel can read as int32 pairs."""
    if x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(0) % 2 == 0 and x.stride(1) % 2 == 0:
        return x
    return x.to(torch.bfloat16).contiguous()


def _launch(kv_cache, fmt, k, v, k_rotation, positions, request, seq_end, slot_mapping, block_table,
            k_clip, v_clip, data, state, launch) -> torch.Tensor:
    n, h, d = k.shape
    if not kv_cache.is_contiguous():
        raise ValueError("OSCAR pages must be one contiguous [blocks, H, KB, C] tensor per layer")
    if d % 32 or d & (d - 1) or fmt.groups not in (1, 2):
        raise ValueError(f"OSCAR's Triton store needs a power-of-two head size >= 32 and group_size head_size "
                         f"or head_size/2, got {d} and {fmt.group_size}")
    if k_rotation is not None and (k_rotation.dim() != 4 or k_rotation.dtype != torch.bfloat16):
        raise ValueError("store_tokens takes R_K as rotation_parts(R_K): [parts, H, D, D] bf16")
    if n == 0:
        return k
    decode = positions is None
    lc = {**default_launch(d, decode), **(launch or {})}
    tpr = lc.pop("tpr")
    rows = 32 * lc["num_warps"] // tpr
    rotate = k_rotation is not None
    if rotate and (k.dtype != torch.bfloat16 or rows < 16):
        # keys that are not bf16 are rotated in fp32 first, as the reference
        # does (the fused rotation is exact for bf16 keys only); so are tiles
        # below the tensor cores' 16 rows
        k_out = torch.einsum("thd,hde->the", k.float(), k_rotation.float().sum(0)).to(torch.bfloat16)
        _launch(kv_cache, fmt, k_out, v, None, positions, request, seq_end, slot_mapping, block_table,
                k_clip, v_clip, data, state, launch)
        return k_out
    kb, vb = _bf16_rows(k), _bf16_rows(v)
    k_out = torch.empty(n, h, d, dtype=torch.bfloat16, device=k.device) if rotate else k
    _store_kernel[(triton.cdiv(n, rows), h)](
        kb, vb, k_rotation if rotate else kb, k_out,
        seq_end if decode else positions, seq_end if decode else request, seq_end,
        seq_end if slot_mapping is None else slot_mapping, block_table, block_table.stride(0),
        kv_cache, n, entries_above_clip(k_clip, d), entries_above_clip(v_clip, d),
        kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1),
        H=h, D=d, G=fmt.group_size, KB=fmt.block_size,
        SINK=fmt.sink, WINDOW=fmt.window, RING=max(fmt.window, 1), STATE_BLOCKS=fmt.state_blocks,
        ROWS=fmt.state_rows_per_block, ROTATE=rotate, ROT_PARTS=k_rotation.shape[0] if rotate else 1,
        DATA=data, STATE=state, T=rows, TPR=tpr, ASM=_compiled(k), DECODE=decode, SLOTS=slot_mapping is not None,
        **lc,
    )
    return k_out
