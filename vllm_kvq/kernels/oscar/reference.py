"""Plain PyTorch OSCAR ops: the CPU path inside vLLM and the ground truth that
every faster kernel is compared against, bit for bit where the math allows.

All functions take rows that are already rotated (``x @ R``). Shapes use
T = tokens, H = KV heads, D = head size, G = group size.
"""

from __future__ import annotations

import torch

from vllm_kvq.kernels.oscar.format import OscarFormat

# ---------------------------------------------------------------------------
# Row quantizer
# ---------------------------------------------------------------------------


def clip_rows(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp each row at its |x| order statistic ``sort(|x|)[int(ratio * D)]``.

    A ratio of 1 or more leaves the row untouched.
    """
    if ratio >= 1.0:
        return x
    d = x.shape[-1]
    idx = min(int(ratio * d), d - 1)
    thr = x.abs().sort(dim=-1).values[..., idx : idx + 1]
    return torch.minimum(torch.maximum(x, -thr), thr)


def quantize_rows(
    x: torch.Tensor, group_size: int, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip and quantize rows ``[..., D]`` to INT2.

    Returns codes ``[..., D]`` (uint8 in 0..3) and ``[..., D/G, 2]`` fp16
    (scale, min). Codes are computed from the fp16-rounded scale and min, so
    dequantizing with the stored pair is exactly what the quantizer intended.
    """
    x = clip_rows(x.float(), clip)
    g = x.unflatten(-1, (x.shape[-1] // group_size, group_size))
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    scale = ((hi - lo) / 3.0).clamp_min(1e-8).to(torch.float16)
    lo16 = lo.to(torch.float16)
    codes = torch.floor(
        (g - lo16.float().unsqueeze(-1)) / scale.float().unsqueeze(-1) + 0.5
    ).clamp_(0, 3)
    return codes.flatten(-2).to(torch.uint8), torch.stack((scale, lo16), dim=-1)


def dequantize_rows(
    codes: torch.Tensor, scale_min: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``code * scale + min`` in fp32."""
    g = codes.float().unflatten(-1, (codes.shape[-1] // group_size, group_size))
    sm = scale_min.float()
    return (g * sm[..., 0:1] + sm[..., 1:2]).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``[..., D]`` codes into ``[..., D/4]`` bytes, quartered order."""
    q = codes.to(torch.uint8).unflatten(-1, (4, codes.shape[-1] // 4))
    return q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Unpack ``[..., D/4]`` bytes into ``[..., D]`` codes."""
    quarters = [(packed >> s) & 3 for s in (0, 2, 4, 6)]
    return torch.cat(quarters, dim=-1)


def fake_quantize(x: torch.Tensor, group_size: int, clip: float) -> torch.Tensor:
    """Quantize then dequantize, as a reader of the cache would see the row."""
    codes, sm = quantize_rows(x, group_size, clip)
    return dequantize_rows(codes, sm, group_size)


# ---------------------------------------------------------------------------
# Page views
# ---------------------------------------------------------------------------


class PageViews:
    """Typed views into one layer's uint8 cache ``[num_blocks, H, KB, C]``."""

    def __init__(self, kv_cache: torch.Tensor, fmt: OscarFormat):
        nb, h = kv_cache.shape[0], kv_cache.shape[1]
        flat = kv_cache.view(nb, h, fmt.block_bytes)
        kb, cb, sb = fmt.block_size, fmt.code_bytes, fmt.scale_bytes

        def region(offset: int, size: int) -> torch.Tensor:
            return flat[:, :, offset : offset + kb * size]

        self.k_codes = region(fmt.k_codes_offset, cb).unflatten(-1, (kb, cb))
        # V codes are byte-major [cb, kb] in the page (format.py); seen as [kb, cb]
        self.v_codes = region(fmt.v_codes_offset, cb).unflatten(-1, (cb, kb)).transpose(-1, -2)
        self.k_scale = (
            region(fmt.k_scale_offset, sb).view(torch.float16).unflatten(-1, (kb, fmt.groups, 2))
        )
        self.v_scale = (
            region(fmt.v_scale_offset, sb).view(torch.float16).unflatten(-1, (kb, fmt.groups, 2))
        )
        rows = fmt.state_rows_per_block
        self.state = (
            flat[:, :, : rows * fmt.state_row_bytes]
            .view(torch.bfloat16)
            .unflatten(-1, (rows, 2, fmt.head_size))
        )


def _data_location(
    block_row: torch.Tensor, positions: torch.Tensor, fmt: OscarFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical data block and offset of each position of one request."""
    idx = fmt.state_blocks + torch.div(positions, fmt.block_size, rounding_mode="floor")
    return block_row[idx].long(), positions % fmt.block_size


def _has_bf16_row(positions: torch.Tensor, seq_len: int, fmt: OscarFormat) -> torch.Tensor:
    """Which positions of a sequence of ``seq_len`` tokens keep a BF16 row:
    the sink and the last W positions."""
    return (positions < fmt.sink) | (positions >= max(seq_len - fmt.window, fmt.sink))


def _state_location(
    block_row: torch.Tensor, positions: torch.Tensor, fmt: OscarFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical state block and row of each sink/window position."""
    slots = torch.where(
        positions < fmt.sink,
        positions,
        fmt.sink + (positions - fmt.sink) % max(fmt.ring, 1),
    )
    rows = fmt.state_rows_per_block
    return block_row[torch.div(slots, rows, rounding_mode="floor")].long(), slots % rows


# ---------------------------------------------------------------------------
# Write path
# ---------------------------------------------------------------------------


def write_request(
    pages: PageViews,
    fmt: OscarFormat,
    block_row: torch.Tensor,
    start: int,
    k: torch.Tensor,
    v: torch.Tensor,
    k_quant: tuple[torch.Tensor, torch.Tensor],
    v_quant: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Store rotated rows ``k, v [T, H, D]`` of positions ``start .. start+T``.

    Every row goes to its data block as INT2 (``k_quant``/``v_quant``: the
    codes and (scale, min) of :func:`quantize_rows`). Sink positions and the
    last W positions of the chunk also go to the request's state blocks in
    BF16 (only the last writer of each ring slot is stored, so the slot ends
    up holding the newest row).
    """
    t = k.shape[0]
    device = k.device
    positions = torch.arange(start, start + t, device=device)
    blk, off = _data_location(block_row, positions, fmt)
    (kc, ks), (vc, vs) = k_quant, v_quant
    pages.k_codes[blk, :, off] = pack_codes(kc)
    pages.v_codes[blk, :, off] = pack_codes(vc)
    pages.k_scale[blk, :, off] = ks
    pages.v_scale[blk, :, off] = vs

    write_state_rows(pages.state, fmt, block_row, start, k, v)


def write_state_rows(state: torch.Tensor, fmt: OscarFormat, block_row: torch.Tensor, start: int,
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


def read_context(
    pages: PageViews, fmt: OscarFormat, block_row: torch.Tensor, ctx: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything a query may read about positions ``0 .. ctx``.

    Returns (k_int2, v_int2, k_bf16, v_bf16, has_bf16): dequantized rows of
    every position ``[ctx, H, D]`` fp32, the BF16 rows where the request still
    has them (sink and the last W positions) and the mask of those positions.
    """
    device = block_row.device
    positions = torch.arange(ctx, device=device)
    blk, off = _data_location(block_row, positions, fmt)
    g = fmt.group_size
    k_q = dequantize_rows(unpack_codes(pages.k_codes[blk, :, off]), pages.k_scale[blk, :, off], g)
    v_q = dequantize_rows(unpack_codes(pages.v_codes[blk, :, off]), pages.v_scale[blk, :, off], g)

    k_hi, v_hi, has_bf16 = read_state_rows(pages.state, fmt, block_row, ctx, k_q)
    return k_q, v_q, k_hi, v_hi, has_bf16


def read_state_rows(state: torch.Tensor, fmt: OscarFormat, block_row: torch.Tensor, ctx: int,
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


def mixed_probs(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k_hi: torch.Tensor,
    k_lo: torch.Tensor,
    sink: int,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax weights of :func:`mixed_attention`, split by the precision each
    (query, key) reads: ``(p_hi, p_lo)``, each ``[H, g, T, S]``."""
    t, hq, d = q.shape
    s, h, _ = k_hi.shape
    group = hq // h
    qg = q.float().view(t, h, group, d).permute(1, 2, 0, 3)  # [H, g, T, D]
    kh, kl = k_hi.permute(1, 0, 2), k_lo.permute(1, 0, 2)  # [H, S, D]
    s_hi = torch.matmul(qg, kh.unsqueeze(1).transpose(-1, -2))  # [H, g, T, S]
    s_lo = torch.matmul(qg, kl.unsqueeze(1).transpose(-1, -2))

    key_pos = torch.arange(s, device=q.device)
    dist = q_positions.view(-1, 1) - key_pos.view(1, -1)  # [T, S]
    use_hi = (key_pos.view(1, -1) < sink) | (dist < window)
    causal = dist >= 0
    logits = torch.where(use_hi, s_hi, s_lo) * scale
    logits = logits.masked_fill(~causal, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    p_hi = p * use_hi
    return p_hi, p - p_hi


def mix_values(p_hi: torch.Tensor, p_lo: torch.Tensor, v_hi: torch.Tensor, v_lo: torch.Tensor) -> torch.Tensor:
    """``p_hi·V_bf16 + p_lo·V_int2`` as ``[T, Hq, D]`` fp32."""
    h, group, t, _ = p_hi.shape
    vh, vl = v_hi.permute(1, 0, 2), v_lo.permute(1, 0, 2)
    out = torch.matmul(p_hi, vh.unsqueeze(1)) + torch.matmul(p_lo, vl.unsqueeze(1))
    return out.permute(2, 0, 1, 3).reshape(t, h * group, -1)


def mixed_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k_hi: torch.Tensor,
    v_hi: torch.Tensor,
    k_lo: torch.Tensor,
    v_lo: torch.Tensor,
    sink: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention where key s is read in BF16 for query t iff
    ``s < sink`` or ``t - s < window``, and INT2 otherwise.

    One exact softmax over both segments. q ``[T, Hq, D]``; keys/values
    ``[S, H, D]`` for positions ``0 .. S`` (fp32). Returns ``[T, Hq, D]`` fp32.
    This is what every query sees in decode, so a chunked prefill gives the
    same result as an unchunked one.
    """
    p_hi, p_lo = mixed_probs(q, q_positions, k_hi, k_lo, sink, window, scale)
    return mix_values(p_hi, p_lo, v_hi, v_lo)


def attend_and_write(
    pages: PageViews,
    fmt: OscarFormat,
    block_row: torch.Tensor,
    ctx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_clip: float,
    v_clip: float,
    scale: float,
) -> torch.Tensor:
    """One request's step: attend rows ``q, k, v`` (positions ``ctx ..``,
    rotated) over cached context plus themselves, then store ``k, v``.

    Returns the attention output in the rotated V basis, ``[T, Hq, D]`` fp32.
    """
    t = q.shape[0]
    g = fmt.group_size
    k_bf = k.to(torch.bfloat16).float()
    v_bf = v.to(torch.bfloat16).float()
    k_quant = quantize_rows(k_bf, g, k_clip)
    v_quant = quantize_rows(v_bf, g, v_clip)
    k_lo_new = dequantize_rows(*k_quant, g)
    v_lo_new = dequantize_rows(*v_quant, g)
    if ctx > 0:
        k_q, v_q, k_hi, v_hi, _ = read_context(pages, fmt, block_row, ctx)
        k_lo = torch.cat((k_q, k_lo_new))
        v_lo = torch.cat((v_q, v_lo_new))
        k_hi = torch.cat((k_hi, k_bf))
        v_hi = torch.cat((v_hi, v_bf))
    else:
        k_lo, v_lo, k_hi, v_hi = k_lo_new, v_lo_new, k_bf, v_bf
    q_pos = torch.arange(ctx, ctx + t, device=q.device)
    out = mixed_attention(q, q_pos, k_hi, v_hi, k_lo, v_lo, fmt.sink, fmt.window, scale)
    write_request(pages, fmt, block_row, ctx, k_bf, v_bf, k_quant, v_quant)
    return out
