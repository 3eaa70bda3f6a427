"""Plain PyTorch ops of the tiered cache (the CPU path inside vLLM, and the
ground truth for any faster kernel). Rows are already rotated (``x @ R``); the
sink/window state blocks, the data-block addressing and the attention itself
are OSCAR's (:mod:`vllm_kvq.kernels.oscar.reference`), only the row codec
differs. Shapes: T tokens, H KV heads, D head size.
"""

from __future__ import annotations

import torch

from vllm_kvq.kernels.oscar import reference as oscar
from vllm_kvq.kernels.tiered.format import Tiers, TieredFormat, stored

# ---------------------------------------------------------------------------
# Row codec
# ---------------------------------------------------------------------------


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 2:
        return oscar.pack_codes(codes)
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 2:
        return oscar.unpack_codes(packed)
    return torch.cat((packed & 15, packed >> 4), dim=-1)


def quantize_tiers(x: torch.Tensor, tiers: Tiers, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., D]`` -> packed codes ``[..., code_bytes]`` uint8 and fp16
    (scale, min) ``[..., stored tiers, 2]``. Each stored tier is one group:
    INT2 tiers are clipped at ``clip`` first (as OSCAR INT2), INT4 tiers not."""
    x = x.float()
    codes, pairs = [], []
    for start, width, bits in stored(tiers):
        seg = x[..., start:start + width]
        if bits == 2:
            seg = oscar.clip_rows(seg, clip)
        levels = (1 << bits) - 1
        lo, hi = seg.amin(dim=-1, keepdim=True), seg.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / levels).clamp_min(1e-8).to(torch.float16)
        lo16 = lo.to(torch.float16)
        c = torch.floor((seg - lo16.float()) / scale.float() + 0.5).clamp_(0, levels).to(torch.uint8)
        codes.append(_pack(c, bits))
        pairs.append(torch.cat((scale, lo16), dim=-1))
    return torch.cat(codes, dim=-1), torch.stack(pairs, dim=-2)


def dequantize_tiers(codes: torch.Tensor, pairs: torch.Tensor, tiers: Tiers,
                     fill: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`quantize_tiers`; 0-bit tiers read ``fill`` (``[H, w0]``,
    their calibrated means, broadcast over tokens). fp32 ``[..., D]``."""
    parts, at, i, f = [], 0, 0, 0
    lead = codes.shape[:-1]
    for width, bits in tiers:
        if bits == 0:
            parts.append(fill[..., f:f + width].float().expand(*lead, width))
            f += width
            continue
        nbytes = width * bits // 8
        c = _unpack(codes[..., at:at + nbytes], bits).float()
        sm = pairs[..., i, :].float()
        parts.append(c * sm[..., 0:1] + sm[..., 1:2])
        at += nbytes
        i += 1
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------


class TieredPages:
    """Views into one layer's uint8 cache ``[num_blocks, H, KB, C]``: token rows
    of data blocks, and OSCAR's BF16 state rows."""

    def __init__(self, kv_cache: torch.Tensor, fmt: TieredFormat):
        nb, h = kv_cache.shape[0], kv_cache.shape[1]
        self.k_codes = kv_cache[..., : fmt.v_codes_offset]
        self.v_codes = kv_cache[..., fmt.v_codes_offset: fmt.k_pairs_offset]
        pairs = kv_cache[..., fmt.k_pairs_offset: fmt.bytes_per_token].view(torch.float16)
        nk = len(stored(fmt.k_tiers))
        self.k_pairs = pairs[..., : 2 * nk].unflatten(-1, (nk, 2))
        self.v_pairs = pairs[..., 2 * nk:].unflatten(-1, (len(stored(fmt.v_tiers)), 2))
        rows = fmt.state_rows_per_block
        flat = kv_cache.view(nb, h, fmt.block_bytes)
        self.state = flat[:, :, : rows * fmt.state_row_bytes].view(torch.bfloat16).unflatten(
            -1, (rows, 2, fmt.head_size))


def read_context(pages: TieredPages, fmt: TieredFormat, block_row: torch.Tensor, ctx: int,
                 k_fill, v_fill):
    """As :func:`oscar.reference.read_context`: (k_quant, v_quant, k_bf16,
    v_bf16, has_bf16) of positions ``0 .. ctx``."""
    positions = torch.arange(ctx, device=block_row.device)
    blk, off = oscar._data_location(block_row, positions, fmt)
    k_q = dequantize_tiers(pages.k_codes[blk, :, off], pages.k_pairs[blk, :, off], fmt.k_tiers, k_fill)
    v_q = dequantize_tiers(pages.v_codes[blk, :, off], pages.v_pairs[blk, :, off], fmt.v_tiers, v_fill)
    k_hi, v_hi, has_bf16 = oscar.read_state_rows(pages.state, fmt, block_row, ctx, k_q)
    return k_q, v_q, k_hi, v_hi, has_bf16


def write_request(pages: TieredPages, fmt: TieredFormat, block_row: torch.Tensor, start: int,
                  k: torch.Tensor, v: torch.Tensor, k_quant, v_quant) -> None:
    """Store rows of positions ``start ..``: every row tiered into its data
    block, sink and window rows also BF16 into the state blocks."""
    positions = torch.arange(start, start + k.shape[0], device=k.device)
    blk, off = oscar._data_location(block_row, positions, fmt)
    pages.k_codes[blk, :, off], pages.k_pairs[blk, :, off] = k_quant
    pages.v_codes[blk, :, off], pages.v_pairs[blk, :, off] = v_quant
    oscar.write_state_rows(pages.state, fmt, block_row, start, k, v)


def attend_and_write(pages: TieredPages, fmt: TieredFormat, block_row: torch.Tensor, ctx: int,
                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_clip: float, v_clip: float,
                     scale: float, k_fill: torch.Tensor | None, v_fill: torch.Tensor | None) -> torch.Tensor:
    """One request's step, as :func:`oscar.reference.attend_and_write` with the
    tiered row codec. Returns ``[T, Hq, D]`` fp32 in the rotated V basis."""
    k_bf = k.to(torch.bfloat16).float()
    v_bf = v.to(torch.bfloat16).float()
    k_quant = quantize_tiers(k_bf, fmt.k_tiers, k_clip)
    v_quant = quantize_tiers(v_bf, fmt.v_tiers, v_clip)
    k_lo = dequantize_tiers(*k_quant, fmt.k_tiers, k_fill)
    v_lo = dequantize_tiers(*v_quant, fmt.v_tiers, v_fill)
    k_hi, v_hi = k_bf, v_bf
    if ctx > 0:
        k_q, v_q, k_h, v_h, _ = read_context(pages, fmt, block_row, ctx, k_fill, v_fill)
        k_lo, v_lo = torch.cat((k_q, k_lo)), torch.cat((v_q, v_lo))
        k_hi, v_hi = torch.cat((k_h, k_hi)), torch.cat((v_h, v_hi))
    q_pos = torch.arange(ctx, ctx + q.shape[0], device=q.device)
    out = oscar.mixed_attention(q, q_pos, k_hi, v_hi, k_lo, v_lo, fmt.sink, fmt.window, scale)
    write_request(pages, fmt, block_row, ctx, k_bf, v_bf, k_quant, v_quant)
    return out
