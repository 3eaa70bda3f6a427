"""Value-rotation fold into FP8 weights: requantized groups stay within half an
FP8 step of the exact rotation of the dequantized weight; untouched groups
keep their bytes."""

import torch
from torch import nn

from vllm_kvq.backends import fp8_weights
from vllm_kvq.artifacts.builtin import hadamard

D = 128


def fp8_linear(rows: int, cols: int, block=None, widths=None, seed=0) -> nn.Module:
    """A linear layer laid out as vLLM's Fp8LinearMethod registers it, quantized from random weights."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 0.1
    linear = nn.Module()
    linear.weight = nn.Parameter(torch.zeros(rows, cols, dtype=fp8_weights.FP8), requires_grad=False)
    if block is not None:
        linear.weight_block_size = block
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        linear.weight_scale_inv = nn.Parameter(torch.ones(grid), requires_grad=False)
    else:
        linear.logical_widths = widths
        linear.weight_scale = nn.Parameter(torch.ones(len(widths)), requires_grad=False)
    fp8_weights.requantize(linear, dense, slice(0, rows), slice(0, cols))
    return linear


def rotate_rows(start: int, rotations: torch.Tensor):
    def apply(w: torch.Tensor) -> None:
        for j, r in enumerate(rotations):
            w[start + j * D : start + (j + 1) * D] = r.t() @ w[start + j * D : start + (j + 1) * D]
    return apply


def check_fold(linear: nn.Module, rotate, rows: slice, cols: slice, scale_name: str) -> None:
    before_codes = linear.weight.data.clone()
    before_scale = getattr(linear, scale_name).data.clone()
    expected = fp8_weights.dequantize(linear)
    rotate(expected)
    fp8_weights.requantize(linear, fp8_weights.dequantize(linear).clone().copy_(expected), rows, cols)
    got = fp8_weights.dequantize(linear)
    scale, groups = fp8_weights._groups(linear)
    touched = 0
    for r, c, idx in groups:
        inside = r.start < rows.stop and rows.start < r.stop and c.start < cols.stop and cols.start < c.stop
        if not inside:
            assert torch.equal(linear.weight.data[r, c].view(torch.uint8), before_codes[r, c].view(torch.uint8))
            assert torch.equal(scale.data[idx], before_scale[idx])
            continue
        touched += 1
        # e4m3 spacing at the top binade [256, 448] is 32 codes: half of it, times the group's scale
        err = (got[r, c] - expected[r, c]).abs().max().item()
        assert err <= 16 * scale.data[idx].item() * (1 + 1e-6), (idx, err)
        assert (expected[r, c].abs().amax() / scale.data[idx]).item() <= fp8_weights.FP8_MAX * (1 + 1e-6)
    assert touched > 0
    rel = ((got - expected).norm() / expected.norm()).item()
    assert 0 < rel < 0.04, rel


def test_block_quantized_qkv_rows_and_o_columns():
    """GLM-4.7-FP8's layout: 128x128 blocks; V rows of a fused QKV, then o_proj columns."""
    hq, hkv = 4, 2
    qkv = fp8_linear((hq + 2 * hkv) * D, 256, block=[128, 128])
    rot = torch.stack([hadamard(D), torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(1)))[0]])
    v_rows = slice((hq + hkv) * D, (hq + 2 * hkv) * D)
    check_fold(qkv, rotate_rows(v_rows.start, rot), v_rows, slice(0, 256), "weight_scale_inv")

    o_proj = fp8_linear(256, hq * D, block=[128, 128], seed=2)

    def rotate_cols(w):
        for h in range(hq):
            w[:, h * D : (h + 1) * D] = w[:, h * D : (h + 1) * D] @ rot[h // (hq // hkv)]
    check_fold(o_proj, rotate_cols, slice(0, 256), slice(0, hq * D), "weight_scale_inv")


def test_unaligned_head_rows_requantize_every_block_they_touch():
    """Blocks of 96 rows straddle 128-row heads: the partly touched blocks are refitted too."""
    qkv = fp8_linear(4 * D, 192, block=[96, 96], seed=3)
    rot = hadamard(D)[None]
    check_fold(qkv, rotate_rows(3 * D, rot), slice(3 * D, 4 * D), slice(0, 192), "weight_scale_inv")


def test_per_tensor_shard_scales():
    """Per-tensor FP8: the V shard gets a new scale, Q and K keep theirs."""
    hq, hkv = 2, 1
    qkv = fp8_linear((hq + 2 * hkv) * D, 256, widths=[hq * D, hkv * D, hkv * D], seed=4)
    v_rows = slice((hq + hkv) * D, (hq + 2 * hkv) * D)
    check_fold(qkv, rotate_rows(v_rows.start, hadamard(D)[None]), v_rows, slice(0, 256), "weight_scale")


def test_unsupported_scale_dtype_is_named():
    linear = fp8_linear(128, 128, block=[128, 128])
    linear.weight_scale_inv = nn.Parameter(torch.ones(1, 1, dtype=torch.int32), requires_grad=False)
    try:
        fp8_weights.dequantize(linear)
    except NotImplementedError as err:
        assert "block scales" in str(err) and "rotation='none'" in str(err)
    else:
        raise AssertionError("an integer scale tensor was accepted")
