"""The KIVI-style reference ops against an independent whole-sequence computation."""

import pytest
import torch

from vllm_kvq.kernels.kivi import reference as kivi
from vllm_kvq.kernels.kivi.format import KiviFormat


def test_format_sizes_and_limits():
    fmt = KiviFormat(head_size=128, block_size=128, sink=64, window=256)
    # codes 32 + 32, per-channel key pairs 128 x 4 B / 32 positions, value pair 4 B
    assert fmt.bytes_per_token == 84
    assert fmt.k_scale_offset == 128 * 64 and fmt.v_scale_offset == 128 * 64 + 128 * 16
    assert fmt.v_scale_offset + 128 * 4 == fmt.block_bytes
    with pytest.raises(ValueError, match="window must be >= 32"):
        KiviFormat(head_size=128, block_size=128, sink=64, window=16)
    with pytest.raises(ValueError, match="must divide the block size"):
        KiviFormat(head_size=128, block_size=48, sink=64, window=256)
    # 64-position key groups: keys 2.5 bits, values 2.25 (2.375 on average)
    assert KiviFormat(head_size=128, block_size=128, sink=64, window=256,
                      token_group=64).bytes_per_token == 76
    # int8 key pairs: 2 x 128 + 2 B per 32-position group -> 9 B per token; 2.406 bits/element
    int8 = KiviFormat(head_size=128, block_size=128, sink=64, window=256, key_pairs="int8")
    assert int8.bytes_per_token == 77 and int8.k_group_bytes == 258


def _int2(x, lo, hi):
    """Independent min-max INT2 with fp16 (scale, min), broadcast over x."""
    scale = torch.clamp((hi - lo) / 3, min=1e-8).half().float()
    lo = lo.half().float()
    return torch.clamp(torch.floor((x - lo) / scale + 0.5), 0, 3) * scale + lo


def _int8_pairs(seg):
    """Independent int8 (min, max) pairs: steps of fp16(max |k| / 120) per head."""
    step = (seg.abs().amax(dim=(0, 2), keepdim=True) / 120).half().float()
    lo = torch.floor(seg.min(0, keepdim=True).values / step) * step
    hi = torch.ceil(seg.max(0, keepdim=True).values / step) * step
    scale = (hi - lo) / 3
    return torch.clamp(torch.floor((seg - lo) / scale + 0.5), 0, 3) * scale + lo


def _keys(kb, tg, pairs):
    out = kb.clone()
    for g0 in range(0, kb.shape[0] - tg + 1, tg):
        seg = kb[g0 : g0 + tg]
        out[g0 : g0 + tg] = (_int8_pairs(seg) if pairs == "int8" else
                             _int2(seg, seg.min(0, keepdim=True).values, seg.max(0, keepdim=True).values))
    return out


def _expected(q, k, v, sink, window, group, scale, tg=32, pairs="fp16"):
    """Whole sequence at once: keys per channel over complete 32-position
    groups, values per token over `group` channels; key s read in BF16 for
    query t iff s < sink or t - s < window."""
    s_len, h, d = k.shape
    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    k_lo = _keys(kb, tg, pairs)
    v_lo = torch.empty_like(vb)
    for c0 in range(0, d, group):
        seg = vb[..., c0 : c0 + group]
        v_lo[..., c0 : c0 + group] = _int2(seg, seg.min(-1, keepdim=True).values, seg.max(-1, keepdim=True).values)
    hq = q.shape[1]
    pos = torch.arange(s_len)
    dist = pos[:, None] - pos[None, :]
    bf = (pos[None, :] < sink) | (dist < window)
    out = torch.empty(s_len, hq, d)
    for i in range(hq):
        j = i // (hq // h)
        qi = q[:, i].float()
        logits = torch.where(bf, qi @ kb[:, j].T, qi @ k_lo[:, j].T) * scale
        p = torch.softmax(logits.masked_fill(dist < 0, float("-inf")), -1)
        out[:, i] = (p * bf) @ vb[:, j] + (p * ~bf) @ v_lo[:, j]
    return out


@pytest.mark.parametrize("chunks,tg,pairs", [
    ([300], 32, "fp16"), ([1] * 40 + [260], 32, "fp16"), ([64] * 4 + [7, 37], 32, "fp16"),
    ([33, 5, 100, 31, 1, 1, 129], 32, "fp16"), ([33, 5, 100, 31, 1, 1, 129], 64, "fp16"),
    ([1] * 70 + [130], 64, "fp16"), ([33, 5, 100, 31, 1, 1, 129], 32, "int8"), ([1] * 40 + [260], 32, "int8"),
])
def test_paged_steps_match_the_whole_sequence(chunks, tg, pairs):
    torch.manual_seed(0)
    d, h, hq, length = 64, 2, 4, sum(chunks)
    fmt = KiviFormat(head_size=d, block_size=64, sink=8, window=max(40, tg + 4), token_group=tg,
                     key_pairs=pairs)
    q, k, v = (torch.randn(length, n, d) for n in (hq, h, h))
    k[:, :, 5] *= 12  # an outlier channel: the case per-channel keys are for
    num_blocks = fmt.state_blocks + -(-length // fmt.block_size)
    cache = torch.full((num_blocks + 3, h, fmt.block_size, fmt.bytes_per_token), 0xFF, dtype=torch.uint8)
    row = torch.randperm(num_blocks + 3)[:num_blocks]  # stale 0xFF bytes (fp16 NaN) everywhere else
    pages = kivi.KiviPages(cache, fmt)
    got, ctx = [], 0
    for n in chunks:
        got.append(kivi.attend_and_write(pages, fmt, row, ctx, q[ctx : ctx + n], k[ctx : ctx + n],
                                         v[ctx : ctx + n], 1.0, 0.125))
        ctx += n
    got = torch.cat(got)
    want = _expected(q, k, v, fmt.sink, fmt.window, d, 0.125, tg, pairs)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # The pages hold every complete key group per channel: dequantized, they
    # are the independent computation's INT2 keys.
    k_q, _, _, _ = kivi.read_context(pages, fmt, row, length)
    full = (length // tg) * tg
    exp = _keys(k.bfloat16().float()[:full], tg, pairs)
    torch.testing.assert_close(k_q[:full], exp, atol=1e-6, rtol=0)


def test_old_keys_are_really_quantized():
    """Far keys go through INT2: outputs differ from BF16 attention by more
    than rounding, and less than with per-token INT2 on an outlier channel."""
    torch.manual_seed(1)
    d, h, length = 64, 1, 256
    fmt = KiviFormat(head_size=d, block_size=64, sink=0, window=32)
    q, k, v = torch.randn(length, h, d), torch.randn(length, h, d), torch.randn(length, h, d)
    k[:, :, 3] *= 20
    cache = torch.zeros(fmt.state_blocks + 4, h, 64, fmt.bytes_per_token, dtype=torch.uint8)
    row = torch.arange(fmt.state_blocks + 4)
    out = kivi.attend_and_write(kivi.KiviPages(cache, fmt), fmt, row, 0, q, k, v, 1.0, 0.125)
    exact = _expected(q, k, v, 0, 1 << 20, 64, 0.125)
    err = (out - exact).norm() / exact.norm()
    assert err > 1e-3
    from vllm_kvq.kernels.oscar import reference as oscar
    from vllm_kvq.kernels.oscar.format import TierPlan

    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    int2 = TierPlan.int2_only(64)
    per_token = oscar.mixed_attention(q, torch.arange(length), kb, vb, oscar.fake_quantize(kb, int2, 1.0),
                                      oscar.fake_quantize(vb, int2, 1.0), 0, 32, 0.125)
    assert err < (per_token - exact).norm() / exact.norm()
