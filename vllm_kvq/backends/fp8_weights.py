"""FP8 linear weights as they sit between loading and vLLM's repacking.

Folding the value rotation into an FP8 checkpoint (GLM-4.7-FP8, DeepSeek-style
block quantization, or per-tensor scales per fused shard) cannot rotate the
fp8 codes in place: rotated rows mix values with different scales and exceed
the codes' range. So the fold dequantizes the weight, rotates in fp32, and
requantizes only the scale groups the rotation touched with fresh absmax
scales; every other group keeps its codes and scale bit for bit.

Layouts handled, as vLLM's ``Fp8LinearMethod`` registers them before
``process_weights_after_loading``:

- block: ``weight`` [out, in] float8_e4m3fn, ``weight_scale_inv`` [ceil(out/bo),
  ceil(in/bi)] fp32/bf16, block (bo, bi) from ``weight_block_size``;
- per-tensor: ``weight`` [out, in] float8_e4m3fn, ``weight_scale`` [shards]
  (one per ``logical_widths`` entry, a fused QKV has three).
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def is_fp8(linear: nn.Module) -> bool:
    weight = getattr(linear, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dtype == FP8


def _groups(linear: nn.Module) -> tuple[torch.Tensor, list[tuple[slice, slice, tuple[int, ...]]]]:
    """The scale tensor and, per scale entry, the (rows, cols) of the weight it covers."""
    rows, cols = linear.weight.shape
    block = getattr(linear, "weight_block_size", None)
    if block is not None:
        scale = linear.weight_scale_inv
        if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise NotImplementedError(
                f"OSCAR cannot requantize FP8 weights with {scale.dtype} block scales; "
                "use a checkpoint with fp32 scales or kvq.rotation='none'")
        bo, bi = block
        return scale, [(slice(i * bo, min((i + 1) * bo, rows)), slice(j * bi, min((j + 1) * bi, cols)), (i, j))
                       for i in range(scale.shape[0]) for j in range(scale.shape[1])]
    scale = linear.weight_scale
    widths = list(getattr(linear, "logical_widths", None) or [rows])
    if scale.numel() != len(widths) or sum(widths) != rows:
        raise NotImplementedError(
            f"OSCAR cannot read this FP8 layout (weight {tuple(linear.weight.shape)}, "
            f"scale {tuple(scale.shape)}, shards {widths}); use kvq.rotation='none'")
    return scale, [(slice(sum(widths[:i]), sum(widths[: i + 1])), slice(0, cols), (i,)) for i in range(len(widths))]


def dequantize(linear: nn.Module) -> torch.Tensor:
    """The weight in fp32, each scale group times its scale."""
    scale, groups = _groups(linear)
    out = linear.weight.data.float()
    for r, c, idx in groups:
        out[r, c] *= scale.data[idx].float()
    return out


def requantize(linear: nn.Module, dense: torch.Tensor, rows: slice, cols: slice) -> None:
    """Store ``dense`` (fp32, the whole weight) back into the FP8 codes,
    refitting only the scale groups that intersect ``rows`` x ``cols``."""
    scale, groups = _groups(linear)
    for r, c, idx in groups:
        if not (r.start < rows.stop and rows.start < r.stop and c.start < cols.stop and cols.start < c.stop):
            continue
        part = dense[r, c]
        s = (part.abs().amax() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        s = s.to(scale.dtype).float()  # the scale as stored; codes are fitted to it
        linear.weight.data[r, c] = (part / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale.data[idx] = s.to(scale.dtype)
