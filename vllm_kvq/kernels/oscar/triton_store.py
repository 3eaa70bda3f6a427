"""Fused OSCAR write path: rotate K, clip, quantize each tier, pack, and store
the BF16 sink/window rows, in one launch per layer.

Twin of :func:`reference.write_request` (plus the K rotation and
:func:`reference.quantize`) for every token of a batch at once; the pages it
writes equal the reference's bit for bit. A program takes ``T`` rows (tokens)
of one KV head. The layer's tier plan is compile-time: each stored tier is
read as a ``[T, bytes, planes]`` tile whose slot ``(b, j)`` is the element
that goes to bits ``j`` of code byte ``b`` (4 INT2 or 2 INT4 planes), so
packing is a sum over the last axis.

* **clip threshold** (INT2 tiers): the bf16 magnitude pattern ``c`` with more
  than ``A`` entries at or above it (``sort(|x|)[w - 1 - A]``), found bit by
  bit. K and V share the two 16-bit halves of one int32 with a guard bit
  above each magnitude, so ``(|x| | 0x8000) - c`` keeps bit 15 of a half iff
  ``|x| >= c``; one byte permute (PRMT, sign-replicating) turns two such words
  into 0xFF flags in four byte counters, and the row's sum times 255^-1 mod
  2^32 gives the counts. The search starts in the octave below the row's
  largest magnitude (7 bits) and falls back to all 15 bits in a tile where a
  row's threshold lies lower.
* **codes**: ``clamp(floor((x - min) / scale + 0.5), 0, levels)`` with the
  division correctly rounded from one reciprocal per row (``q0 = a r``,
  refined by one residual: Markstein); INT2 codes are counted against the
  three points where the rounding steps (``q >= 0.5 - 2^-25, 1.5, 2.5``).

A token at position -1 (its request has length 0: the padding vLLM adds to a
batch replayed from a CUDA graph) or with a negative slot writes nothing.

The window ring has ``fmt.ring`` slots (``W + k`` with ``k`` speculative
tokens a step), addressed ``S0 + (p - S0) mod ring`` as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.oscar.format import OscarFormat
from vllm_kvq.kernels.oscar.triton_decode import _compiled


def default_launch(head_size: int, decode: bool = False) -> dict:
    """Rows per program: 4,096 elements of a kind a program at 4 warps (32
    rows at D = 128), half that for a decode step, whose few tokens fill more
    programs; at least the 16 rows the tensor-core rotation takes."""
    return {"num_warps": 4, "rows": max((2048 if decode else 4096) // head_size, 16)}


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
    c = cand[:, None, None]
    s = tl.sum(tl.sum(_flags(pl - c, ph - c, ASM), axis=2), axis=1)
    f = s * -16843009
    return (f & 0xFF) + ((f >> 8) & 0xFF), ((f >> 16) & 0xFF) + ((f >> 24) & 0xFF)


@triton.jit
def _clip_thresholds(pl, ph, mk, mv, k_above, v_above, ASM: tl.constexpr):
    """bf16 magnitude patterns of each row's clip threshold, K and V: the
    largest c with more than ``*_above`` entries >= c (sort(|x|)[w-1-above])."""
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
def _ge(q, h, ASM: tl.constexpr):
    """-1 where q >= h, else 0 (one SET instruction compiled)."""
    if ASM:
        return tl.inline_asm_elementwise("set.ge.u32.f32 $0, $1, $2;", "=r,r,r", [q, h],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return -(q >= h).to(tl.int32)


@triton.jit
def _floor_int(x, ASM: tl.constexpr):
    """floor(x) as int32 (one F2I rounding down, compiled)."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rmi.s32.f32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True,
                                         pack=1)
    return tl.floor(x).to(tl.int32)


@triton.jit
def _tier_slots(START: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, P: tl.constexpr):
    """Element (from the row's start) and validity of each (byte, plane) slot
    of a tier of NB code bytes and P planes, as ``[NBP, P]``."""
    b = tl.arange(0, NBP)[:, None]
    j = tl.arange(0, P)[None, :]
    return START + b + j * NB, (b < NB) & (j < P)


@triton.jit
def _load_tier(rows, ok, START: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, P: tl.constexpr):
    """bf16 bits (int32, zero where no element) of a tier's slots for rows at
    ``rows [T]`` (int16 pointers), and the slots' validity ``[1, NBP, P]``."""
    elem, valid = _tier_slots(START, NB, NBP, P)
    bits = tl.load(rows[:, None, None] + elem[None, :, :], mask=ok[:, None, None] & valid[None, :, :], other=0)
    return bits.to(tl.int32) & 0xFFFF, valid[None, :, :]


@triton.jit
def _minmax(bits, valid):
    x = (bits << 16).to(tl.float32, bitcast=True)
    mn = tl.min(tl.min(tl.where(valid, x, float("inf")), axis=2), axis=1)
    mx = tl.max(tl.max(tl.where(valid, x, float("-inf")), axis=2), axis=1)
    return mn, mx


@triton.jit
def _magnitude(mn, mx):
    """bf16 magnitude pattern of a row's largest |entry|."""
    return (tl.maximum(mx, -mn).to(tl.int32, bitcast=True) >> 16) & 0x7FFF


@triton.jit
def _quantize(bits, valid, lo, hi, LEVELS: tl.constexpr, ASM: tl.constexpr):
    """Packed code bytes ``[T, NBP]`` and (scale | min << 16) words ``[T]`` of
    one tier's slots, its row min/max (after clipping) given."""
    scale = tl.maximum(tl.math.div_rn(hi - lo, LEVELS * 1.0), 1e-8).to(tl.float16)
    lo16 = lo.to(tl.float16)
    s = scale.to(tl.float32)
    r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    pair = (scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (lo16.to(tl.int16, bitcast=True).to(tl.int32) << 16)
    x = (bits << 16).to(tl.float32, bitcast=True)
    a = x - lo16.to(tl.float32)[:, None, None]
    r3 = r[:, None, None]
    q0 = a * r3
    rem = tl.fma(q0, -s[:, None, None], a)
    q = tl.where((s > 0)[:, None, None], tl.fma(rem, r3, q0), q0)
    if LEVELS == 3:
        code = -(_ge(q, 0.4999999701976776, ASM) + _ge(q, 1.5, ASM) + _ge(q, 2.5, ASM))
        shift = 2 * tl.arange(0, 4)
    else:
        code = tl.minimum(tl.maximum(_floor_int(q + 0.5, ASM), 0), LEVELS)
        shift = 4 * tl.arange(0, 2)
    code = tl.where(valid, code, 0)
    return tl.sum(code << shift[None, None, :], axis=2), pair


@triton.jit
def _clamp(bits, thr):
    """bf16 bits clamped to [-thr, thr] (``thr [T]`` a magnitude pattern)."""
    x = (bits << 16).to(tl.float32, bitcast=True)
    t = (thr << 16).to(tl.float32, bitcast=True)[:, None, None]
    return (tl.minimum(tl.maximum(x, -t), t).to(tl.int32, bitcast=True) >> 16) & 0xFFFF


@triton.jit
def _store_codes(cache_u8, base, off, live, codes, BYTE0: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                 ROW_BYTES: tl.constexpr, BYTE_MAJOR: tl.constexpr, KB: tl.constexpr):
    """Code bytes ``[T, NBP]`` into a code region at ``base``: token-major rows
    of ROW_BYTES (K) or byte-major (V: byte b of token t at b KB + t)."""
    b = BYTE0 + tl.arange(0, NBP)
    if BYTE_MAJOR:
        at = cache_u8 + base[:, None] + b[None, :] * KB + off[:, None]
    else:
        at = cache_u8 + base[:, None] + off[:, None] * ROW_BYTES + b[None, :]
    tl.store(at, codes.to(tl.uint8), mask=live[:, None] & (b < BYTE0 + NB)[None, :])


@triton.jit
def _store_kernel(
    k_ptr, v_ptr, rot_ptr, k_out_ptr,
    pos_ptr, req_ptr, end_ptr, slot_ptr, bt_ptr, bt_stride,
    cache_u8,
    n_tokens, k_clip_above, v_clip_above,
    stride_kt, stride_kh, stride_vt, stride_vh,
    H: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, S: tl.constexpr,
    K4: tl.constexpr, K2: tl.constexpr, V4: tl.constexpr, V2: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr, STATE_BLOCKS: tl.constexpr, ROWS: tl.constexpr,
    ROTATE: tl.constexpr, ROT_PARTS: tl.constexpr, DATA: tl.constexpr, STATE: tl.constexpr,
    T: tl.constexpr, ASM: tl.constexpr, DECODE: tl.constexpr, SLOTS: tl.constexpr, Q: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    KC: tl.constexpr = K4 // 2 + K2 // 4
    VC: tl.constexpr = V4 // 2 + V2 // 4
    NK: tl.constexpr = (K4 > 0) + (K2 > 0)
    NV: tl.constexpr = (V4 > 0) + (V2 > 0)
    BLOCK_BYTES: tl.constexpr = KB * (KC + VC + 4 * (NK + NV))

    if ROTATE:
        # k @ R (R as ROT_PARTS bf16 parts summing to it: fp32-accurate on bf16
        # keys), in slices of RC input dims; rounded to bf16 into k_out, which the
        # tiers below then read back in their own layout
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

    tok = pid_t * T + tl.arange(0, T)
    tok_ok = tok < n_tokens
    if DECODE:  # Q tokens a request, the last Q positions of its sequence
        req = tok // Q
        end = tl.load(end_ptr + req, mask=tok_ok, other=0)
        pos = end - Q + tok % Q
    else:
        pos = tl.load(pos_ptr + tok, mask=tok_ok, other=-1)
        req = tl.load(req_ptr + tok, mask=tok_ok, other=0)
        end = tl.load(end_ptr + tok, mask=tok_ok, other=0)
    live = tok_ok & (pos >= 0)
    if SLOTS:
        live = live & (tl.load(slot_ptr + tok, mask=tok_ok, other=-1) >= 0)
    row = bt_ptr + req.to(tl.int64) * bt_stride
    k_rows = k_src.to(tl.pointer_type(tl.int16)) + tok.to(tl.int64) * skt + h * skh
    v_rows = v_ptr.to(tl.pointer_type(tl.int16)) + tok.to(tl.int64) * stride_vt + h * stride_vh

    if DATA:
        blk = tl.load(row + STATE_BLOCKS + pos // KB, mask=live, other=0).to(tl.int64)
        off = pos % KB
        base = blk * S + h * BLOCK_BYTES
        k_pairs = (cache_u8 + base + KB * (KC + VC) + off * (4 * NK)).to(tl.pointer_type(tl.int32))
        v_pairs = (cache_u8 + base + KB * (KC + VC + 4 * NK) + off * (4 * NV)).to(tl.pointer_type(tl.int32))
        if K2 + V2 > 0:
            # the INT2 tiers of K and V, side by side in one tile for the clip search
            NB2: tl.constexpr = max(K2, V2) // 4
            NB2P: tl.constexpr = triton.next_power_of_2(NB2)
            kb2, kval2 = _load_tier(k_rows, tok_ok, K4, K2 // 4, NB2P, 4)
            vb2, vval2 = _load_tier(v_rows, tok_ok, V4, V2 // 4, NB2P, 4)
            kmn, kmx = _minmax(kb2, kval2)
            vmn, vmx = _minmax(vb2, vval2)
            tk = _magnitude(kmn, kmx)
            tv = _magnitude(vmn, vmx)
            if (k_clip_above >= 0) | (v_clip_above >= 0):
                m = (kb2 & 0x7FFF) | ((vb2 & 0x7FFF) << 16) | -2147450880  # | 0x80008000: guard bits
                pl, ph = tl.split(tl.reshape(m, (T, NB2P, 2, 2)))
                tk, tv = _clip_thresholds(pl, ph, tk, tv, k_clip_above, v_clip_above, ASM)
            if K2 > 0:
                tkf = (tk << 16).to(tl.float32, bitcast=True)
                codes, pair = _quantize(_clamp(kb2, tk), kval2, tl.maximum(kmn, -tkf), tl.minimum(kmx, tkf), 3, ASM)
                _store_codes(cache_u8, base, off, live, codes, K4 // 2, K2 // 4, NB2P, KC, False, KB)
                tl.store(k_pairs + (NK - 1), pair, mask=live)
            if V2 > 0:
                tvf = (tv << 16).to(tl.float32, bitcast=True)
                codes, pair = _quantize(_clamp(vb2, tv), vval2, tl.maximum(vmn, -tvf), tl.minimum(vmx, tvf), 3, ASM)
                _store_codes(cache_u8, base + KB * KC, off, live, codes, V4 // 2, V2 // 4, NB2P, VC, True, KB)
                tl.store(v_pairs + (NV - 1), pair, mask=live)
        if K4 > 0:
            NB4: tl.constexpr = K4 // 2
            bits, valid = _load_tier(k_rows, tok_ok, 0, NB4, triton.next_power_of_2(NB4), 2)
            mn, mx = _minmax(bits, valid)
            codes, pair = _quantize(bits, valid, mn, mx, 15, ASM)
            _store_codes(cache_u8, base, off, live, codes, 0, NB4, triton.next_power_of_2(NB4), KC, False, KB)
            tl.store(k_pairs, pair, mask=live)
        if V4 > 0:
            NBV4: tl.constexpr = V4 // 2
            bits, valid = _load_tier(v_rows, tok_ok, 0, NBV4, triton.next_power_of_2(NBV4), 2)
            mn, mx = _minmax(bits, valid)
            codes, pair = _quantize(bits, valid, mn, mx, 15, ASM)
            _store_codes(cache_u8, base + KB * KC, off, live, codes, 0, NBV4, triton.next_power_of_2(NBV4), VC,
                         True, KB)
            tl.store(v_pairs, pair, mask=live)

    if STATE:  # BF16 rows of the sink and of the last W positions of this chunk
        keep = live & ((pos < SINK) | (pos >= tl.maximum(end - WINDOW, SINK)))
        slot = tl.where(pos < SINK, pos, SINK + (pos - SINK) % RING)
        sblk = tl.load(row + slot // ROWS, mask=keep, other=0).to(tl.int64)
        srow = cache_u8.to(tl.pointer_type(tl.int16)) + (sblk * S + h * BLOCK_BYTES + (slot % ROWS) * (4 * D)) // 2
        d = tl.arange(0, D)
        tl.store(srow[:, None] + d[None, :], tl.load(k_rows[:, None] + d[None, :], mask=keep[:, None]),
                 mask=keep[:, None])
        tl.store(srow[:, None] + D + d[None, :], tl.load(v_rows[:, None] + d[None, :], mask=keep[:, None]),
                 mask=keep[:, None])


def entries_above_clip(ratio: float, width: int) -> int:
    """How many entries of a tier of ``width`` lie above the order statistic
    that :func:`reference.clip_rows` clamps at (-1: no clip)."""
    if ratio >= 1.0 or width == 0:
        return -1
    return width - 1 - min(int(ratio * width), width - 1)


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
    slot_mapping: torch.Tensor | None = None,
    query_len: int = 1,
) -> torch.Tensor:
    """Rotate ``k`` (``[N, H, D]``, unrotated) by ``k_rotation`` (the
    :func:`rotation_parts` of R_K, or None) and store ``k, v`` of every token in
    the paged cache.

    Per token: its ``positions``, ``request`` (row of ``block_table``) and
    ``seq_end`` (that request's length after this step). Returns the rotated
    keys in bf16 ``[N, H, D]`` (``k`` itself when there is no rotation).

    ``data``/``state`` select the quantized rows and the BF16 sink/window rows;
    ``launch``: ``{"num_warps", "rows"}`` over :func:`default_launch`. A
    multi-token chunk stores its quantized rows, attends, then stores its BF16
    rows: its early queries still need the ring rows its later tokens overwrite.
    Without ``positions`` and ``request``: :func:`store_decode_tokens`.
    """
    n, h, d = k.shape
    block_stride = fmt.block_stride(kv_cache)
    why = check_shapes(d)
    if why:
        raise ValueError(why)
    if k_rotation is not None and (k_rotation.dim() != 4 or k_rotation.dtype != torch.bfloat16):
        raise ValueError("store_tokens takes R_K as rotation_parts(R_K): [parts, H, D, D] bf16")
    if n == 0:
        return k
    decode = positions is None
    lc = {**default_launch(d, decode), **(launch or {})}
    rows = lc.pop("rows")
    rotate = k_rotation is not None
    if rotate and (k.dtype != torch.bfloat16 or rows < 16):
        # keys that are not bf16 are rotated in fp32 first, as the reference
        # does (the fused rotation is exact for bf16 keys only); so are tiles
        # below the tensor cores' 16 rows
        k_out = torch.einsum("thd,hde->the", k.float(), k_rotation.float().sum(0)).to(torch.bfloat16)
        store_tokens(kv_cache, fmt, k_out, v, None, positions, request, seq_end, block_table, k_clip, v_clip, data,
                     state, launch, slot_mapping, query_len)
        return k_out
    kb, vb = _bf16_rows(k), _bf16_rows(v)
    k_out = torch.empty(n, h, d, dtype=torch.bfloat16, device=k.device) if rotate else k
    _store_kernel[(triton.cdiv(n, rows), h)](
        kb, vb, k_rotation if rotate else kb, k_out,
        seq_end if decode else positions, seq_end if decode else request, seq_end,
        seq_end if slot_mapping is None else slot_mapping, block_table, block_table.stride(0),
        kv_cache, n, entries_above_clip(k_clip, fmt.k.int2), entries_above_clip(v_clip, fmt.v.int2),
        kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1),
        H=h, D=d, KB=fmt.block_size, S=block_stride, K4=fmt.k.int4, K2=fmt.k.int2, V4=fmt.v.int4, V2=fmt.v.int2,
        SINK=fmt.sink, WINDOW=fmt.window, RING=max(fmt.ring, 1), STATE_BLOCKS=fmt.state_blocks,
        ROWS=fmt.state_rows_per_block, ROTATE=rotate, ROT_PARTS=k_rotation.shape[0] if rotate else 1,
        DATA=data, STATE=state, T=rows, ASM=_compiled(k), DECODE=decode, SLOTS=slot_mapping is not None,
        Q=query_len, **lc,
    )
    return k_out


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
    query_len: int = 1,
) -> torch.Tensor:
    """:func:`store_tokens` for a batch of requests of ``query_len`` tokens
    each (one decoded token, or one plus the drafts being verified): token
    ``i`` is request ``i // query_len``'s, at position ``seq_lens[i //
    query_len] - query_len + i % query_len``. All of them are stored, BF16
    rows included, before attention reads: with ``query_len <= 1 + k`` and a
    ring of ``W + k`` slots a new row only replaces one no query of the step
    reads in BF16.

    Reads nothing but device tensors (no per-step index), so a CUDA graph that
    captured it replays any batch written into the same ``seq_lens``,
    ``block_table`` and ``slot_mapping`` buffers. Tokens of length-0 requests
    and, with ``slot_mapping``, tokens whose slot is negative (vLLM's padding
    and dummy batches) write nothing.
    """
    fmt.check_query_len(query_len)
    return store_tokens(kv_cache, fmt, k, v, k_rotation, None, None, seq_lens, block_table, k_clip, v_clip,
                        launch=launch, slot_mapping=slot_mapping, query_len=query_len)


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as bf16 rows with unit element stride."""
    if x.dtype == torch.bfloat16 and x.stride(2) == 1:
        return x
    return x.to(torch.bfloat16).contiguous()


def check_shapes(head_size: int) -> str | None:
    """Why the Triton kernels cannot take this head size (None if they can)."""
    if head_size < 32 or head_size & (head_size - 1):
        return f"the Triton kernels need a power-of-two head size >= 32, got {head_size}"
    return None

