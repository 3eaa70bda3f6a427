"""Plain PyTorch OSCAR ops: the CPU path inside vLLM and the ground truth that
every faster kernel is compared against, bit for bit where the math allows.

All functions take rows that are already rotated (``x @ R``). Shapes use
T = tokens, H = KV heads, D = head size. The row codec follows a
:class:`~vllm_kvq.kernels.oscar.format.TierPlan`; the byte layout is
:mod:`vllm_kvq.kernels.oscar.format`'s.
"""

from __future__ import annotations

import torch

from vllm_kvq.kernels.oscar.format import OscarFormat, PagedFormat, TierPlan

# ---------------------------------------------------------------------------
# Row codec
# ---------------------------------------------------------------------------


def clip_rows(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp each row at its |x| order statistic ``sort(|x|)[int(ratio * w)]``.

    A ratio of 1 or more leaves the row untouched.
    """
    if ratio >= 1.0:
        return x
    w = x.shape[-1]
    idx = min(int(ratio * w), w - 1)
    thr = x.abs().kthvalue(idx + 1, dim=-1, keepdim=True).values  # sorted |x|'s element idx, without a sort
    return torch.minimum(torch.maximum(x, -thr), thr)


def _minmax_codes(seg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[..., w]`` of one group and its fp16 (scale, min) ``[..., 2]``;
    the codes are computed from the fp16-rounded pair, which is what a reader
    dequantizes with."""
    levels = (1 << bits) - 1
    lo, hi = seg.amin(dim=-1, keepdim=True), seg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(1e-8).to(torch.float16)
    lo16 = lo.to(torch.float16)
    codes = torch.floor((seg - lo16.float()) / scale.float() + 0.5).clamp_(0, levels).to(torch.uint8)
    return codes, torch.cat((scale, lo16), dim=-1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., w]`` codes of one tier into ``[..., w * bits / 8]`` bytes:
    quartered (INT2) or halved (INT4)."""
    parts = codes.to(torch.uint8).unflatten(-1, (8 // bits, -1))
    out = parts[..., 0, :].clone()
    for j in range(1, 8 // bits):
        out |= parts[..., j, :] << (bits * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`."""
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * j)) & mask for j in range(8 // bits)], dim=-1)


def quantize(x: torch.Tensor, plan: TierPlan, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., D]`` -> packed codes ``[..., code_bytes]`` uint8 and fp16
    (scale, min) ``[..., stored tiers, 2]``. INT2 tiers are clipped at
    ``clip`` first, INT4 tiers not; 0-bit tiers are dropped."""
    x = x.float()
    codes, pairs = [], []
    if plan.int4:
        c, p = _minmax_codes(x[..., : plan.int4], 4)
        codes.append(pack_codes(c, 4))
        pairs.append(p)
    if plan.int2:
        c, p = _minmax_codes(clip_rows(x[..., plan.int4 : plan.int4 + plan.int2], clip), 2)
        codes.append(pack_codes(c, 2))
        pairs.append(p)
    return torch.cat(codes, dim=-1), torch.stack(pairs, dim=-2)


def dequantize(codes: torch.Tensor, pairs: torch.Tensor, plan: TierPlan,
               fill: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize` in fp32 ``[..., D]``: ``code * scale +
    min``; the 0-bit tier reads ``fill`` (``[H, zero]``, its calibrated mean,
    broadcast over the leading axes; zeros without one)."""
    lead = codes.shape[:-1]
    parts, at, i = [], 0, 0
    for width, bits in plan.pairs:
        if bits == 0:
            f = torch.zeros(width, device=codes.device) if fill is None else fill.float()
            parts.append(f.expand(*lead, width))
            continue
        n = width * bits // 8
        sm = pairs[..., i, :].float()
        parts.append(unpack_codes(codes[..., at : at + n], bits).float() * sm[..., 0:1] + sm[..., 1:2])
        at += n
        i += 1
    return torch.cat(parts, dim=-1)


def fake_quantize(x: torch.Tensor, plan: TierPlan, clip: float, fill: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize, as a reader of the cache would see the row."""
    return dequantize(*quantize(x, plan, clip), plan, fill)


# ---------------------------------------------------------------------------
# Page views
# ---------------------------------------------------------------------------


def state_rows(kv_cache: torch.Tensor, fmt: PagedFormat) -> torch.Tensor:
    """The BF16 state slots of every block, ``[blocks, H, rows, 2, D]``."""
    nb, h = kv_cache.shape[0], kv_cache.shape[1]
    rows = fmt.state_rows_per_block
    flat = kv_cache.view(nb, h, fmt.block_bytes)
    return flat[:, :, : rows * fmt.state_row_bytes].view(torch.bfloat16).unflatten(-1, (rows, 2, fmt.head_size))


class PageViews:
    """Typed views into one layer's uint8 cache ``[num_blocks, H, KB, C]``,
    token-indexed: ``k_codes``/``v_codes`` ``[nb, H, KB, bytes]`` (V's a view
    of its byte-major region), ``k_pairs``/``v_pairs`` ``[nb, H, KB, tiers, 2]``."""

    def __init__(self, kv_cache: torch.Tensor, fmt: OscarFormat):
        nb, h = kv_cache.shape[0], kv_cache.shape[1]
        flat = kv_cache.view(nb, h, fmt.block_bytes)
        kb, kc, vc = fmt.block_size, fmt.k.code_bytes, fmt.v.code_bytes

        def region(offset: int, size: int) -> torch.Tensor:
            return flat[:, :, offset : offset + kb * size]

        self.k_codes = region(0, kc).unflatten(-1, (kb, kc))
        self.v_codes = region(fmt.v_codes_offset, vc).unflatten(-1, (vc, kb)).transpose(-1, -2)
        self.k_pairs, self.v_pairs = (region(at, 4 * t.stored).view(torch.float16).unflatten(-1, (kb, t.stored, 2))
                                      for at, t in ((fmt.k_pairs_offset, fmt.k), (fmt.v_pairs_offset, fmt.v)))
        self.state = state_rows(kv_cache, fmt)


def data_location(block_row: torch.Tensor, positions: torch.Tensor,
                  fmt: PagedFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical data block and offset of each position of one request."""
    idx = fmt.state_blocks + torch.div(positions, fmt.block_size, rounding_mode="floor")
    return block_row[idx].long(), positions % fmt.block_size


def _has_bf16_row(positions: torch.Tensor, seq_len: int, fmt: PagedFormat) -> torch.Tensor:
    """Which positions of a sequence of ``seq_len`` tokens keep a BF16 row:
    the sink and the last W positions."""
    return (positions < fmt.sink) | (positions >= max(seq_len - fmt.window, fmt.sink))


def _state_location(block_row: torch.Tensor, positions: torch.Tensor,
                    fmt: PagedFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical state block and row of each sink/window position."""
    slots = torch.where(positions < fmt.sink, positions, fmt.sink + (positions - fmt.sink) % max(fmt.ring, 1))
    rows = fmt.state_rows_per_block
    return block_row[torch.div(slots, rows, rounding_mode="floor")].long(), slots % rows


# ---------------------------------------------------------------------------
# Write path
# ---------------------------------------------------------------------------


def write_request(pages: PageViews, fmt: OscarFormat, block_row: torch.Tensor, start: int,
                  k: torch.Tensor, v: torch.Tensor, k_quant, v_quant) -> None:
    """Store rotated rows ``k, v [T, H, D]`` of positions ``start .. start+T``:
    every row into its data block (``k_quant``/``v_quant``: :func:`quantize`'s
    codes and pairs), sink positions and the chunk's last W positions also in
    BF16 into the request's state blocks."""
    positions = torch.arange(start, start + k.shape[0], device=k.device)
    blk, off = data_location(block_row, positions, fmt)
    pages.k_codes[blk, :, off], pages.k_pairs[blk, :, off] = k_quant
    pages.v_codes[blk, :, off], pages.v_pairs[blk, :, off] = v_quant
    write_state_rows(pages.state, fmt, block_row, start, k, v)


def write_state_rows(state: torch.Tensor, fmt: PagedFormat, block_row: torch.Tensor, start: int,
                     k: torch.Tensor, v: torch.Tensor) -> None:
    """BF16 copies of rows ``k, v [T, H, D]`` (positions ``start ..``) that the
    request keeps after this chunk: its sink and last W positions (only the
    last writer of each ring slot is stored). Shared by every page format."""
    positions = torch.arange(start, start + k.shape[0], device=k.device)
    keep = _has_bf16_row(positions, start + k.shape[0], fmt)
    if bool(keep.any()):
        sel = keep.nonzero().squeeze(-1)
        sblk, srow = _state_location(block_row, positions[sel], fmt)
        state[sblk, :, srow, 0] = k[sel].to(torch.bfloat16)
        state[sblk, :, srow, 1] = v[sel].to(torch.bfloat16)


# ---------------------------------------------------------------------------
# Read path
# ---------------------------------------------------------------------------


def read_context(pages: PageViews, fmt: OscarFormat, block_row: torch.Tensor, ctx: int,
                 fills=(None, None)):
    """Everything a query may read about positions ``0 .. ctx``: (k_quant,
    v_quant, k_bf16, v_bf16, has_bf16), the dequantized rows of every
    position ``[ctx, H, D]`` fp32, the BF16 rows where the request still has
    them (sink and the last W positions) and their mask. ``fills``: the K
    and V 0-bit tiers' means ``[H, zero]``."""
    positions = torch.arange(ctx, device=block_row.device)
    blk, off = data_location(block_row, positions, fmt)
    k_q = dequantize(pages.k_codes[blk, :, off], pages.k_pairs[blk, :, off], fmt.k, fills[0])
    v_q = dequantize(pages.v_codes[blk, :, off], pages.v_pairs[blk, :, off], fmt.v, fills[1])
    k_hi, v_hi, has_bf16 = read_state_rows(pages.state, fmt, block_row, ctx, k_q)
    return k_q, v_q, k_hi, v_hi, has_bf16


def read_state_rows(state: torch.Tensor, fmt: PagedFormat, block_row: torch.Tensor, ctx: int,
                    like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_bf16, v_bf16, has_bf16) of positions ``0 .. ctx``: the BF16 rows the
    request still holds (sink and last W positions) as fp32 ``like``-shaped
    tensors, zero elsewhere, and their mask. Shared by every page format."""
    positions = torch.arange(ctx, device=block_row.device)
    has_bf16 = _has_bf16_row(positions, ctx, fmt)
    k_hi, v_hi = torch.zeros_like(like), torch.zeros_like(like)
    if bool(has_bf16.any()):
        sel = has_bf16.nonzero().squeeze(-1)
        sblk, srow = _state_location(block_row, positions[sel], fmt)
        k_hi[sel] = state[sblk, :, srow, 0].float()
        v_hi[sel] = state[sblk, :, srow, 1].float()
    return k_hi, v_hi, has_bf16


def mixed_probs(q: torch.Tensor, q_positions: torch.Tensor, k_hi: torch.Tensor, k_lo: torch.Tensor,
                sink: int, window: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax weights of :func:`mixed_attention`, split by the precision each
    (query, key) reads: ``(p_hi, p_lo)``, each ``[H, g, T, S]``."""
    t, hq, d = q.shape
    s, h, _ = k_hi.shape
    g = hq // h
    # One product a KV head, keys times the group's query rows (a broadcast
    # over the group copies the keys g times: ~30x slower for a decode row on
    # CPU). In this order CPU BLAS gives a query row the same scores whatever
    # the number of rows beside it (measured, not promised), so a verification
    # step's rows score as their decode steps do.
    qg = q.float().view(t, h, g, d).permute(1, 3, 2, 0).reshape(h, d, g * t)  # [H, D, g T]
    s_hi = torch.matmul(k_hi.permute(1, 0, 2), qg).view(h, s, g, t).permute(0, 2, 3, 1)  # [H, g, T, S]
    s_lo = torch.matmul(k_lo.permute(1, 0, 2), qg).view(h, s, g, t).permute(0, 2, 3, 1)
    key_pos = torch.arange(s, device=q.device)
    dist = q_positions.view(-1, 1) - key_pos.view(1, -1)  # [T, S]
    use_hi = (key_pos.view(1, -1) < sink) | (dist < window)
    logits = torch.where(use_hi, s_hi, s_lo) * scale
    p = torch.softmax(logits.masked_fill(dist < 0, float("-inf")), dim=-1)
    p_hi = p * use_hi
    return p_hi, p - p_hi


def mix_values(p_hi: torch.Tensor, p_lo: torch.Tensor, v_hi: torch.Tensor, v_lo: torch.Tensor) -> torch.Tensor:
    """``p_hi·V_bf16 + p_lo·V_quant`` as ``[T, Hq, D]`` fp32."""
    h, group, t, s = p_hi.shape
    vh, vl = v_hi.permute(1, 0, 2), v_lo.permute(1, 0, 2)  # [H, S, D]
    # the group's rows times the values: the order in which a row's result
    # does not move with the row count, as above
    out = torch.matmul(p_hi.reshape(h, group * t, s), vh) + torch.matmul(p_lo.reshape(h, group * t, s), vl)
    return out.view(h, group, t, -1).permute(2, 0, 1, 3).reshape(t, h * group, -1)


def mixed_attention(q: torch.Tensor, q_positions: torch.Tensor, k_hi: torch.Tensor, v_hi: torch.Tensor,
                    k_lo: torch.Tensor, v_lo: torch.Tensor, sink: int, window: int, scale: float) -> torch.Tensor:
    """Causal attention where key s is read in BF16 for query t iff
    ``s < sink`` or ``t - s < window``, and quantized otherwise.

    One exact softmax over both segments. q ``[T, Hq, D]``; keys/values
    ``[S, H, D]`` for positions ``0 .. S`` (fp32). Returns ``[T, Hq, D]`` fp32.
    This is what every query sees in decode, so a chunked prefill gives the
    same result as an unchunked one.
    """
    p_hi, p_lo = mixed_probs(q, q_positions, k_hi, k_lo, sink, window, scale)
    return mix_values(p_hi, p_lo, v_hi, v_lo)


def attend_and_write(pages: PageViews, fmt: OscarFormat, block_row: torch.Tensor, ctx: int,
                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_clip: float, v_clip: float,
                     scale: float, fills=(None, None)) -> torch.Tensor:
    """One request's step: attend rows ``q, k, v`` (positions ``ctx ..``,
    rotated) over the cached context plus themselves, then store ``k, v``.

    Returns the attention output in the rotated V basis, ``[T, Hq, D]`` fp32.
    """
    k_bf = k.to(torch.bfloat16).float()
    v_bf = v.to(torch.bfloat16).float()
    k_quant = quantize(k_bf, fmt.k, k_clip)
    v_quant = quantize(v_bf, fmt.v, v_clip)
    k_lo = dequantize(*k_quant, fmt.k, fills[0])
    v_lo = dequantize(*v_quant, fmt.v, fills[1])
    k_hi, v_hi = k_bf, v_bf
    if ctx > 0:
        k_q, v_q, k_h, v_h, _ = read_context(pages, fmt, block_row, ctx, fills)
        k_lo, v_lo = torch.cat((k_q, k_lo)), torch.cat((v_q, v_lo))
        k_hi, v_hi = torch.cat((k_h, k_hi)), torch.cat((v_h, v_hi))
    q_pos = torch.arange(ctx, ctx + q.shape[0], device=q.device)
    out = mixed_attention(q, q_pos, k_hi, v_hi, k_lo, v_lo, fmt.sink, fmt.window, scale)
    write_request(pages, fmt, block_row, ctx, k_bf, v_bf, k_quant, v_quant)
    return out
