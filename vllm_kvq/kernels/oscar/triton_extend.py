"""OSCAR prefill / extend: a chunk of query tokens over the request's
quantized + BF16 history and the chunk itself.

Twin of :func:`reference.mixed_attention` as :func:`reference.attend_and_write`
uses it: query t reads key s in BF16 iff ``s < S0`` or ``t - s < W``,
quantized otherwise, causal, one exact softmax. Run it after the chunk's
quantized rows are stored and before its BF16 rows are
(``triton_store.store_tokens`` with ``state=False``, then this, then
``data=False``): its early queries need the ring rows that its later tokens
overwrite.

Grid ``(tiles, H, head blocks)``; a tile is up to ``BLOCK_M`` consecutive query
tokens of one request, and a program serves them for ``HEADS`` query heads of
one KV head at once (GQA: every quantized row is dequantized once for
``BLOCK_M * HEADS`` query rows, whatever its tiers). Keys are visited in three
ranges, so that only the last one pays for both precisions:

* sink ``[0, S0)``: BF16 rows;
* ``[S0, t_min - W]``: quantized for every query of the tile;
* ``(t_min - W, t_max]``: both, chosen per (query, key).

BF16 rows of context positions come from the ring slots, of chunk positions
from the chunk's own (rotated) keys and values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.oscar.format import OscarFormat
from vllm_kvq.kernels.oscar.triton_decode import LOG2E, _page_base, fill_tensor, page_step, softmax_step

BLOCK_M = 16  # query tokens per tile
# rows: query rows (tokens x heads) per program; the best of the H200 sweep at head size 128
LAUNCH = {"rows": 64, "block_n": 64, "num_warps": 4}


def default_launch(head_size: int) -> dict:
    """The launch for ``head_size``: the fp32 accumulators are rows x head size,
    so each doubling past 128 halves the rows and the key tile (head size 256
    then spills 36-44 B for sm_90a instead of 1.5 KB; sized by registers, not timed)."""
    wide = max(head_size, 128) // 128
    launch = {**LAUNCH, "rows": max(64 // wide, 16), "block_n": max(64 // wide, 16)}
    if head_size < 128:  # see key_tile: 4 warps there fault at 48-token blocks (Triton 3.6, H100)
        launch["num_warps"] = 2
    return launch


def key_tile(block_n: int, head_size: int, block_size: int) -> int:
    """The key tile a launch asking for ``block_n`` gets: at most the largest
    power of two within the block (a page's last tile is partial where the
    tile does not divide the block) and at most half the head size. Compiled by Triton 3.6 for the H200, 64-key tiles
    at head size 64 give wrong outputs (64-token blocks) or fault (48-token
    blocks), while 32-key tiles there and 64-key tiles at head size 128 match
    the reference; 32-key tiles through 48-token blocks need 2 warps
    (:func:`default_launch`: with 4 the score product's shared memory is
    addressed out of range)."""
    return min(block_n, head_size // 2, 1 << (block_size.bit_length() - 1))


@triton.jit
def _quant_rows(n0, ok, row, cache_u8, cache_i32, fill, S: tl.constexpr, h, V: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr,
                D: tl.constexpr, KB: tl.constexpr, KC: tl.constexpr, VC: tl.constexpr, NK: tl.constexpr,
                NV: tl.constexpr, BLOCK_BYTES: tl.constexpr, STATE_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dequantized K (V=0) or V (1) rows of positions ``n0 .. n0 + BLOCK_N``
    as ``[BLOCK_N, D]`` fp16; rows not ``ok`` read zero scales.

    ``n0`` starts a tile of its page (a multiple of BLOCK_N past the page's
    start), so codes come from one page. A page's last tile may run past it
    where BLOCK_N does not divide KB; its rows there are not ``ok``. Codes are
    read unmasked (every address stays inside the page's own region, which
    the request owns: BLOCK_N <= KB); the masked scales zero the rest. Each
    element is read from its tier's byte and bits: element ``e`` of the INT4
    tier from byte ``e % (W4/2)``, nibble ``e // (W4/2)``; of the INT2 tier
    after the INT4 bytes, crumb ``e' // (W2/4)``; past both, the 0-bit tier's
    calibrated mean.
    """
    NB4: tl.constexpr = W4 // 2
    NB2: tl.constexpr = W2 // 4
    NT: tl.constexpr = NV if V else NK
    e = tl.arange(0, D)
    is4 = e < W4
    is0 = e >= W4 + W2
    e2 = tl.maximum(e - W4, 0)
    byte = tl.where(is4, e % max(NB4, 1), NB4 + e2 % max(NB2, 1))
    shift = tl.where(is4, 4 * (e // max(NB4, 1)), 2 * (e2 // max(NB2, 1)))
    mask = tl.where(is4, 15, 3)
    base = _page_base(row, n0 // KB, S, h, BLOCK_BYTES, STATE_BLOCKS)
    off = n0 % KB + tl.arange(0, BLOCK_N)
    if V:  # V codes are byte-major (format.py)
        at = cache_u8 + base + KB * KC + byte[None, :] * KB + off[:, None]
        pairs = cache_i32 + (base + KB * (KC + VC + 4 * NK)) // 4 + off * NT
    else:
        at = cache_u8 + base + off[:, None] * KC + byte[None, :]
        pairs = cache_i32 + (base + KB * (KC + VC)) // 4 + off * NT
    c = ((tl.load(at, mask=(~is0)[None, :], other=0).to(tl.int32) >> shift[None, :]) & mask[None, :]).to(tl.float32)
    w = tl.load(pairs, mask=ok, other=0)
    s_a = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    m_a = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    if NT == 2:
        w = tl.load(pairs + 1, mask=ok, other=0)
        s_b = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
        m_b = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
        x = tl.where(is4[None, :], c * s_a + m_a, c * s_b + m_b)
    else:
        x = c * s_a + m_a
    Z: tl.constexpr = D - W4 - W2
    if Z > 0:
        f = tl.load(fill + h * Z + tl.maximum(e - (W4 + W2), 0), mask=is0, other=0.0)
        x = tl.where(is0[None, :], f[None, :], x)
    return x.to(tl.float16)


@triton.jit
def _bf16_rows(pos, ok, ctx, qstart, row, cache_bf16, new_ptr, stride_t, stride_h, S: tl.constexpr, h,
               V: tl.constexpr, D: tl.constexpr, BLOCK_BYTES: tl.constexpr,
               SINK: tl.constexpr, RING: tl.constexpr, ROWS: tl.constexpr):
    """K (V=0) or V (1) BF16 rows of ``pos`` as ``[BLOCK_N, D]`` fp16: ring
    slots for context positions, the chunk's own rows for the rest."""
    d = tl.arange(0, D)
    old = ok & (pos < ctx)
    new = ok & (pos >= ctx)
    slot = tl.where(pos < SINK, pos, SINK + (pos - SINK) % RING)
    sblk = tl.load(row + slot // ROWS, mask=old, other=0).to(tl.int64)
    ring = cache_bf16 + sblk * (S // 2) + h * (BLOCK_BYTES // 2) + (slot % ROWS) * (2 * D) + V * D
    chunk = new_ptr + (qstart + pos - ctx).to(tl.int64) * stride_t + h * stride_h
    x = tl.load(ring[:, None] + d[None, :], mask=old[:, None], other=0.0) + \
        tl.load(chunk[:, None] + d[None, :], mask=new[:, None], other=0.0)
    return x.to(tl.float16)


@triton.jit
def _step_of(p, KB: tl.constexpr, BLOCK_N: tl.constexpr):
    """The INT2 step that holds position ``p >= 0`` (steps run page by page)."""
    SUB: tl.constexpr = (KB + BLOCK_N - 1) // BLOCK_N
    return (p // KB) * SUB + (p % KB) // BLOCK_N


@triton.jit
def _steps_before(p, KB: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many INT2 steps hold positions below ``p >= 0``."""
    SUB: tl.constexpr = (KB + BLOCK_N - 1) // BLOCK_N
    return (p // KB) * SUB + ((p % KB) + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _step_rows(step, KB: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first position, positions, inside its page) of an INT2 step's rows."""
    page, r0 = page_step(step, KB, BLOCK_N)
    r = r0 + tl.arange(0, BLOCK_N)  # rows in the page
    n0 = page * KB + r0
    if KB % BLOCK_N == 0:
        inside = tl.full([BLOCK_N], True, tl.int1)
    else:
        inside = r < KB
    return n0, n0 + tl.arange(0, BLOCK_N), inside


@triton.jit
def _extend_kernel(q_ptr, stride_qt, stride_qh, k_ptr, stride_kt, stride_kh, v_ptr, stride_vt, stride_vh,
                   tiles_ptr, bt_ptr, bt_stride, cache_u8, cache_i32, cache_bf16, kfill, vfill,
                   out_ptr, stride_ot, stride_oh,
                   S: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                   K4: tl.constexpr, K2: tl.constexpr, V4: tl.constexpr, V2: tl.constexpr,
                   KB: tl.constexpr, SINK: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr,
                   STATE_BLOCKS: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    KC: tl.constexpr = K4 // 2 + K2 // 4
    VC: tl.constexpr = V4 // 2 + V2 // 4
    NK: tl.constexpr = (K4 > 0) + (K2 > 0)
    NV: tl.constexpr = (V4 > 0) + (V2 > 0)
    BLOCK_BYTES: tl.constexpr = KB * (KC + VC + 4 * (NK + NV))
    QR: tl.constexpr = BLOCK_M * HEADS  # query rows: token-major, heads inside
    req = tl.load(tiles_ptr + tile * 5)
    tok0 = tl.load(tiles_ptr + tile * 5 + 1)
    nq = tl.load(tiles_ptr + tile * 5 + 2)
    ctx = tl.load(tiles_ptr + tile * 5 + 3)
    qstart = tl.load(tiles_ptr + tile * 5 + 4)
    row = bt_ptr + req.to(tl.int64) * bt_stride

    r = tl.arange(0, QR)
    gi = tl.program_id(2) * HEADS + r % HEADS
    tok = tok0 + r // HEADS
    qok = (r // HEADS < nq) & (gi < GROUP)
    hq = h * GROUP + gi
    tpos = ctx + tok - qstart
    t_min = ctx + tok0 - qstart
    t_max = t_min + nq - 1
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :],
                mask=qok[:, None], other=0.0).to(tl.float16)

    m_i = tl.full([QR], float("-inf"), tl.float32)
    l_i = tl.zeros([QR], tl.float32)
    acc = tl.zeros([QR, D], tl.float32)

    # 1. sink: BF16
    sink_end = tl.minimum(SINK, t_max + 1)
    for n0 in range(0, sink_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < sink_end
        k = _bf16_rows(pos, ok, ctx, qstart, row, cache_bf16, k_ptr, stride_kt, stride_kh, S, h, 0, D, BLOCK_BYTES,
                       SINK, RING, ROWS)
        s = tl.dot(q, tl.trans(k))
        live = qok[:, None] & ok[None, :] & (pos[None, :] <= tpos[:, None])
        s = tl.where(live, s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, 1)
        v = _bf16_rows(pos, ok, ctx, qstart, row, cache_bf16, v_ptr, stride_vt, stride_vh, S, h, 1, D, BLOCK_BYTES,
                       SINK, RING, ROWS)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)

    # 2. keys at least W behind every query of the tile: quantized, in steps of
    # BLOCK_N through each page (a page's last step partial where BLOCK_N
    # does not divide KB)
    int2_end = tl.maximum(t_min - WINDOW + 1, SINK)
    int2_lo = _step_of(SINK, KB, BLOCK_N)
    # none when every key is in a window (a chunk inside the sink may not own the sink's last page)
    int2_hi = tl.where(int2_end > SINK, _steps_before(int2_end, KB, BLOCK_N), int2_lo)
    for step in range(int2_lo, int2_hi):
        n0, pos, inside = _step_rows(step, KB, BLOCK_N)
        ok = (pos >= SINK) & (pos < int2_end) & inside
        k = _quant_rows(n0, ok, row, cache_u8, cache_i32, kfill, S, h, 0, K4, K2, D, KB, KC, VC, NK, NV,
                        BLOCK_BYTES, STATE_BLOCKS, BLOCK_N)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(qok[:, None] & ok[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, 1)
        v = _quant_rows(n0, ok, row, cache_u8, cache_i32, vfill, S, h, 1, V4, V2, D, KB, KC, VC, NK, NV,
                        BLOCK_BYTES, STATE_BLOCKS, BLOCK_N)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)

    # 3. the rest, up to the last query: BF16 inside each query's window, quantized beyond
    for step in range(_step_of(int2_end, KB, BLOCK_N), _steps_before(t_max + 1, KB, BLOCK_N)):
        n0, pos, inside = _step_rows(step, KB, BLOCK_N)
        ok = (pos >= int2_end) & (pos <= t_max) & inside
        # ring rows older than ctx - W now hold newer positions; no query here reads them in BF16
        has_bf16 = ok & ((pos >= ctx) | (pos >= ctx - WINDOW))
        k = _quant_rows(n0, ok, row, cache_u8, cache_i32, kfill, S, h, 0, K4, K2, D, KB, KC, VC, NK, NV,
                        BLOCK_BYTES, STATE_BLOCKS, BLOCK_N)
        s_lo = tl.dot(q, tl.trans(k))
        k = _bf16_rows(pos, has_bf16, ctx, qstart, row, cache_bf16, k_ptr, stride_kt, stride_kh, S, h, 0, D,
                       BLOCK_BYTES, SINK, RING, ROWS)
        s_hi = tl.dot(q, tl.trans(k))
        use_hi = (tpos[:, None] - pos[None, :]) < WINDOW
        live = qok[:, None] & ok[None, :] & (pos[None, :] <= tpos[:, None])
        s = tl.where(live, tl.where(use_hi, s_hi, s_lo), float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, 1)
        p_hi = tl.where(use_hi, p, 0.0).to(tl.float16)
        p_lo = tl.where(use_hi, 0.0, p).to(tl.float16)
        v = _quant_rows(n0, ok, row, cache_u8, cache_i32, vfill, S, h, 1, V4, V2, D, KB, KC, VC, NK, NV,
                        BLOCK_BYTES, STATE_BLOCKS, BLOCK_N)
        acc = acc * alpha[:, None] + tl.dot(p_lo, v)
        v = _bf16_rows(pos, has_bf16, ctx, qstart, row, cache_bf16, v_ptr, stride_vt, stride_vh, S, h, 1, D,
                       BLOCK_BYTES, SINK, RING, ROWS)
        acc += tl.dot(p_hi, v)

    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    ob = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + hq[:, None] * stride_oh + d[None, :]
    tl.store(ob, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qok[:, None])


def query_tiles(requests: list[tuple[int, int, int, int]], device) -> torch.Tensor:
    """``[tiles, 5]`` int32 (request row, first token, tokens, ctx, request's
    first token) from ``(request row, first token, chunk length, ctx)``."""
    rows = [(r, t0 + m, min(BLOCK_M, n - m), ctx, t0)
            for r, t0, n, ctx in requests for m in range(0, n, BLOCK_M)]
    return torch.tensor(rows, dtype=torch.int32).view(-1, 5).to(device)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    fmt: OscarFormat,
    block_table: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    launch: dict | None = None,
    fills=(None, None),
) -> torch.Tensor:
    """Attention of chunk queries ``q [N, Hq, D]`` (rotated) with the chunk's
    rotated keys ``k`` and values ``v [N, H, D]`` (bf16), into ``out``.
    ``launch``: rows, block_n, num_warps over :func:`default_launch`;
    ``fills``: the K and V 0-bit tiers' means ``[H, width]``."""
    hq, d = q.shape[1], q.shape[2]
    h = kv_cache.shape[1]
    if tiles.shape[0] == 0:
        return out
    qs = (q.float() * (scale * LOG2E)).contiguous()
    lc = {**default_launch(d), **(launch or {})}
    group = hq // h
    heads = min(triton.next_power_of_2(group), max(1, lc["rows"] // BLOCK_M))
    _extend_kernel[(tiles.shape[0], h, triton.cdiv(group, heads))](
        qs, qs.stride(0), qs.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        tiles, block_table, block_table.stride(0),
        kv_cache, kv_cache.view(torch.int32), kv_cache.view(torch.bfloat16),
        fill_tensor(fills[0], fmt.k.zero, q.device), fill_tensor(fills[1], fmt.v.zero, q.device),
        out, out.stride(0), out.stride(1),
        S=fmt.block_stride(kv_cache), GROUP=group, HEADS=heads, D=d, K4=fmt.k.int4, K2=fmt.k.int2, V4=fmt.v.int4, V2=fmt.v.int2,
        KB=fmt.block_size, SINK=fmt.sink, WINDOW=fmt.window, RING=max(fmt.ring, 1),
        STATE_BLOCKS=fmt.state_blocks, ROWS=fmt.state_rows_per_block,
        BLOCK_M=BLOCK_M, BLOCK_N=key_tile(lc["block_n"], d, fmt.block_size), num_warps=lc["num_warps"],
    )
    return out
