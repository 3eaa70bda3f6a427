"""PyTorch ops of the KIVI-style cache (CPU only; no Triton twin).

Keys: per-channel min-max INT2 over groups of ``T`` positions, written when a
group's last position is stored. Values: per-token INT2 as in OSCAR. The read
rule is OSCAR's (BF16 iff ``s < sink`` or ``t - s < window``); with
``window >= T`` a key whose group is still open is always read in BF16, so the
result does not depend on how a prompt is chunked.
"""

from __future__ import annotations

import torch

from vllm_kvq.kernels.kivi.format import KiviFormat
from vllm_kvq.kernels.oscar import reference as oscar
from vllm_kvq.kernels.oscar.format import TierPlan


STEP_DIVISOR = 120  # int8 pairs: |min|, |max| <= 120 steps (fp16 rounding of the step stays in range)


def quantize_keys(x: torch.Tensor, key_pairs: str):
    """INT2 per channel over the leading axis of x ``[T, H, D]``: codes
    ``[T, H, D]`` uint8, pairs ``[H, D, 2]`` (fp16 (scale, min), or int8 (min,
    max) in steps) and the int8 pairs' fp16 step per head ``[H]`` (None for
    fp16 pairs). Codes use the stored pairs, as the reader will."""
    x = x.float()
    if key_pairs == "int8":
        step = (x.abs().amax(dim=(0, 2)) / STEP_DIVISOR).clamp_min(1e-6).to(torch.float16)
        st = step.float()[:, None]
        pairs = torch.stack((torch.floor(x.amin(0) / st), torch.ceil(x.amax(0) / st)), -1).clamp_(-127, 127)
        pairs = pairs.to(torch.int8)
    else:
        step, lo = None, x.amin(0)
        pairs = torch.stack((((x.amax(0) - lo) / 3.0).clamp_min(1e-8), lo), -1).to(torch.float16)
    scale, lo = _scale_min(pairs, step)
    return torch.floor((x - lo) / scale + 0.5).clamp_(0, 3).to(torch.uint8), pairs, step


def _scale_min(pairs: torch.Tensor, step: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if step is None:
        return pairs[..., 0].float(), pairs[..., 1].float()
    st = step.float()[..., None]
    lo, hi = pairs[..., 0].float() * st, pairs[..., 1].float() * st
    return ((hi - lo) / 3.0).clamp_min(1e-8), lo


def dequantize_keys(codes: torch.Tensor, pairs: torch.Tensor, step: torch.Tensor | None) -> torch.Tensor:
    scale, lo = _scale_min(pairs, step)
    return codes.float() * scale + lo


def fake_quantize_keys(k: torch.Tensor, token_group: int, key_pairs: str) -> torch.Tensor:
    """Keys ``[S, H, D]`` of positions from a group start on, as a reader sees
    them: complete groups dequantized, the open tail as is."""
    out = k.float().clone()
    for g in range(0, k.shape[0] - token_group + 1, token_group):
        out[g : g + token_group] = dequantize_keys(*quantize_keys(k[g : g + token_group], key_pairs))
    return out


class KiviPages:
    """Typed views into one layer's uint8 cache ``[num_blocks, H, KB, C]``."""

    def __init__(self, kv_cache: torch.Tensor, fmt: KiviFormat):
        nb, h = kv_cache.shape[0], kv_cache.shape[1]
        flat = kv_cache.view(nb, h, fmt.block_bytes)
        kb, cb, d = fmt.block_size, fmt.code_bytes, fmt.head_size
        region = lambda offset, size: flat[:, :, offset : offset + size]  # noqa: E731

        self.k_codes = region(0, kb * cb).unflatten(-1, (kb, cb))
        self.v_codes = region(fmt.v_codes_offset, kb * cb).unflatten(-1, (kb, cb))
        groups = kb // fmt.token_group
        k_pairs = region(fmt.k_scale_offset, groups * fmt.k_group_bytes).unflatten(-1, (groups, fmt.k_group_bytes))
        if fmt.key_pairs == "int8":
            self.k_step = k_pairs[..., :2]  # [nb, H, groups, 2] bytes of one fp16
            self.k_scale = k_pairs[..., 2:].view(torch.int8).unflatten(-1, (d, 2))
        else:
            self.k_scale = k_pairs.view(torch.float16).unflatten(-1, (d, 2))
        self.v_scale = region(fmt.v_scale_offset, kb * 4).view(torch.float16).unflatten(-1, (kb, 1, 2))
        self.state = oscar.state_rows(kv_cache, fmt)
        self.values = TierPlan.int2_only(d)  # values: OSCAR INT2 rows


def read_context(pages: KiviPages, fmt: KiviFormat, block_row: torch.Tensor, ctx: int):
    """Rows a query may read about positions ``0 .. ctx``: (k_int2, v_int2,
    k_bf16, v_bf16). Keys of the open group (from ``ctx`` rounded down to a
    group start) have no INT2 form yet: they are the BF16 rows there."""
    positions = torch.arange(ctx, device=block_row.device)
    blk, off = oscar.data_location(block_row, positions, fmt)
    v_q = oscar.dequantize(pages.v_codes[blk, :, off], pages.v_scale[blk, :, off], pages.values)
    k_codes = oscar.unpack_codes(pages.k_codes[blk, :, off], 2)  # [ctx, H, D]
    grp = off // fmt.token_group
    step = pages.k_step[blk, :, grp].contiguous().view(torch.float16)[..., 0] if fmt.key_pairs == "int8" else None
    k_q = dequantize_keys(k_codes, pages.k_scale[blk, :, grp], step)  # step: [ctx, H]
    k_hi, v_hi, _ = oscar.read_state_rows(pages.state, fmt, block_row, ctx, k_q)
    open_start = ctx - ctx % fmt.token_group
    k_q[open_start:] = k_hi[open_start:]
    return k_q, v_q, k_hi, v_hi


def attend_and_write(pages: KiviPages, fmt: KiviFormat, block_row: torch.Tensor, ctx: int,
                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_clip: float,
                     scale: float) -> torch.Tensor:
    """One request's step over positions ``ctx .. ctx+T``: attend over the
    cached context plus the chunk, then store the chunk (value codes, BF16
    rows, and the key groups the chunk completes). Returns ``[T, Hq, D]`` fp32."""
    end = ctx + q.shape[0]
    k_bf, v_bf = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    v_quant = oscar.quantize(v_bf, pages.values, v_clip)
    v_lo_new = oscar.dequantize(*v_quant, pages.values)
    if ctx > 0:
        k_q, v_q, k_hi, v_hi = read_context(pages, fmt, block_row, ctx)
        k_hi, v_hi = torch.cat((k_hi, k_bf)), torch.cat((v_hi, v_bf))
        v_lo = torch.cat((v_q, v_lo_new))
    else:
        k_q = k_bf[:0]
        k_hi, v_hi, v_lo = k_bf, v_bf, v_lo_new
    # Key groups from the open one at ctx up to the chunk's end: BF16 rows of
    # the open group's cached part are in the window (W >= T).
    first = ctx - ctx % fmt.token_group
    tail = k_hi[first:end]
    k_lo = torch.cat((k_q[:first], fake_quantize_keys(tail, fmt.token_group, fmt.key_pairs)))
    q_pos = torch.arange(ctx, end, device=q.device)
    out = oscar.mixed_attention(q, q_pos, k_hi, v_hi, k_lo, v_lo, fmt.sink, fmt.window, scale)
    _write(pages, fmt, block_row, ctx, k_bf, v_bf, v_quant, tail, first)
    return out


def _write(pages: KiviPages, fmt: KiviFormat, block_row: torch.Tensor, ctx: int, k_bf, v_bf, v_quant,
           tail: torch.Tensor, first: int) -> None:
    end = ctx + k_bf.shape[0]
    blk, off = oscar.data_location(block_row, torch.arange(ctx, end, device=k_bf.device), fmt)
    pages.v_codes[blk, :, off], pages.v_scale[blk, :, off] = v_quant
    tg = fmt.token_group
    for g in range(first, end - tg + 1, tg):
        seg = tail[g - first : g - first + tg]
        gblk, goff = oscar.data_location(block_row, torch.arange(g, g + tg, device=k_bf.device), fmt)
        codes, pairs, step = quantize_keys(seg, fmt.key_pairs)
        if step is not None:
            pages.k_step[gblk[0], :, goff[0] // tg] = step.contiguous().view(torch.uint8).view(-1, 2)
        pages.k_codes[gblk, :, goff] = oscar.pack_codes(codes, 2)
        pages.k_scale[gblk[0], :, goff[0] // tg] = pairs
    oscar.write_state_rows(pages.state, fmt, block_row, ctx, k_bf, v_bf)
