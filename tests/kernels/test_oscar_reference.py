"""The OSCAR reference ops against closed-form expectations."""

import pytest
import torch

from vllm_kvq.kernels.oscar import reference as ref
from vllm_kvq.kernels.oscar.format import OscarFormat


def test_default_format_sizes():
    fmt = OscarFormat(head_size=128, group_size=128, block_size=128, sink=64, window=256)
    assert fmt.bytes_per_token == 72  # 2 x (32 B codes + 4 B fp16 scale/min)
    assert fmt.state_rows_per_block == 18
    assert fmt.state_blocks == 18
    assert fmt.k_scale_offset == 128 * 64 and fmt.v_scale_offset == 128 * 68
    # 128K context: 2.25 bits of INT2 for every token plus 18 state blocks.
    assert fmt.bits_per_element(131072) == pytest.approx(
        8 * (131072 * 72 + 18 * 128 * 72) / (256 * 131072), rel=1e-12)
    assert 2.28 < fmt.bits_per_element(131072) < 2.30
    g64 = OscarFormat(head_size=128, group_size=64, block_size=128, sink=64, window=256)
    assert g64.bytes_per_token == 80


def test_pack_is_quartered():
    codes = torch.zeros(1, 16, dtype=torch.uint8)
    codes[0, 1] = 1  # element 1 -> byte 1, bits 0-1
    codes[0, 4 + 1] = 2  # element 5 -> byte 1, bits 2-3
    codes[0, 8 + 1] = 3  # element 9 -> byte 1, bits 4-5
    codes[0, 12 + 1] = 1  # element 13 -> byte 1, bits 6-7
    packed = ref.pack_codes(codes)
    assert packed.tolist() == [[0, 1 | (2 << 2) | (3 << 4) | (1 << 6), 0, 0]]
    rnd = torch.randint(0, 4, (7, 128), dtype=torch.uint8)
    assert torch.equal(ref.unpack_codes(ref.pack_codes(rnd)), rnd)


def test_page_views_put_codes_at_their_format_offsets():
    """K codes token-major, V codes byte-major: byte b of token t at K's
    ``t * D/4 + b`` and V's ``v_codes_offset + b * KB + t`` (format.py)."""
    fmt = OscarFormat(head_size=16, group_size=16, block_size=8, sink=0, window=0)
    cache = torch.zeros(2, 3, fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8)
    pages = ref.PageViews(cache, fmt)
    pages.k_codes[1, 2, 5, 3] = 7
    pages.v_codes[1, 2, 5, 3] = 9
    flat = cache[1, 2].flatten()
    assert flat.nonzero().flatten().tolist() == [5 * 4 + 3, fmt.v_codes_offset + 3 * 8 + 5]
    assert flat[5 * 4 + 3] == 7 and flat[fmt.v_codes_offset + 3 * 8 + 5] == 9


def test_quantize_error_bound_and_levels():
    torch.manual_seed(0)
    x = torch.randn(64, 128) * 3
    codes, sm = ref.quantize_rows(x, 64, clip=1.0)
    assert codes.max() <= 3 and sm.dtype == torch.float16 and sm.shape == (64, 2, 2)
    xh = ref.dequantize_rows(codes, sm, 64)
    scale = sm[..., 0].float().repeat_interleave(64, dim=-1)
    # Rounding to the nearest of 4 levels: error <= half a step (+ fp16 slack).
    assert ((xh - x).abs() <= scale / 2 + 1e-2).all()
    # Extremes of each group are represented (min exactly up to fp16).
    assert torch.allclose(xh.view(64, 2, 64).amin(-1), x.view(64, 2, 64).amin(-1), atol=2e-2)


def test_clip_clamps_the_top_order_statistics():
    x = torch.arange(1, 129, dtype=torch.float32).unsqueeze(0)
    c = ref.clip_rows(x, 0.96)  # idx = 122 -> threshold is the 123rd smallest |x| = 123
    assert c.max().item() == 123.0 and (c == 123.0).sum().item() == 6
    assert torch.equal(ref.clip_rows(x, 1.0), x)


def _dense_attention(q, k, v, scale):
    t, hq, d = q.shape
    h = k.shape[1]
    qg = q.view(t, h, hq // h, d)
    logits = torch.einsum("thgd,shd->hgts", qg, k) * scale
    mask = torch.ones(t, k.shape[0], dtype=torch.bool).tril(k.shape[0] - t)
    p = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("hgts,shd->thgd", p, v).reshape(t, hq, d)


def _pages(fmt, num_blocks, heads):
    return torch.zeros(num_blocks, heads, fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8)


def test_all_bf16_when_sequence_fits_sink_and_window():
    torch.manual_seed(1)
    fmt = OscarFormat(head_size=64, group_size=64, block_size=32, sink=8, window=64)
    n, h, g = 70, 2, 3
    q, k, v = torch.randn(n, h * g, 64), torch.randn(n, h, 64), torch.randn(n, h, 64)
    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    cache = _pages(fmt, 64, h)
    row = torch.arange(1, 40)
    out = ref.attend_and_write(ref.PageViews(cache, fmt), fmt, row, 0, q, k, v, 1.0, 1.0, 0.125)
    assert torch.allclose(out, _dense_attention(q, kb, vb, 0.125), atol=1e-5)


def test_chunked_equals_unchunked_and_pages_match():
    torch.manual_seed(2)
    fmt = OscarFormat(head_size=64, group_size=32, block_size=16, sink=4, window=8)
    n, h, g = 61, 2, 2
    q, k, v = torch.randn(n, h * g, 64), torch.randn(n, h, 64), torch.randn(n, h, 64)
    row = torch.randperm(60)[: fmt.state_blocks + 4] + 1
    whole = _pages(fmt, 64, h)
    out_whole = ref.attend_and_write(ref.PageViews(whole, fmt), fmt, row, 0, q, k, v, 0.96, 0.92, 0.125)
    chunked = _pages(fmt, 64, h)
    outs, start = [], 0
    for size in (5, 1, 17, 3, 1, 34):
        views = ref.PageViews(chunked, fmt)
        outs.append(ref.attend_and_write(views, fmt, row, start, q[start:start + size],
                                         k[start:start + size], v[start:start + size], 0.96, 0.92, 0.125))
        start += size
    assert start == n
    assert torch.allclose(torch.cat(outs), out_whole, atol=1e-5)
    # INT2 pages are bit-identical; state rows hold the sink and the last W rows.
    data = row[fmt.state_blocks:]
    assert torch.equal(whole[data], chunked[data])
    state_w = ref.PageViews(whole, fmt).state[row[: fmt.state_blocks]]
    state_c = ref.PageViews(chunked, fmt).state[row[: fmt.state_blocks]]
    assert torch.equal(state_w, state_c)


def test_old_keys_are_read_as_int2():
    """Far from the window, a query sees exactly the dequantized rows."""
    torch.manual_seed(3)
    fmt = OscarFormat(head_size=64, group_size=64, block_size=16, sink=0, window=1)
    n, h = 40, 1
    q, k, v = torch.randn(n, h, 64), torch.randn(n, h, 64), torch.randn(n, h, 64)
    cache = _pages(fmt, 16, h)
    row = torch.arange(1, 1 + fmt.state_blocks + 3)
    out = ref.attend_and_write(ref.PageViews(cache, fmt), fmt, row, 0, q, k, v, 1.0, 1.0, 0.125)
    kq = ref.fake_quantize(k.bfloat16().float(), 64, 1.0)
    vq = ref.fake_quantize(v.bfloat16().float(), 64, 1.0)
    # Last query: every earlier key INT2, itself BF16.
    kmix, vmix = kq.clone(), vq.clone()
    kmix[-1], vmix[-1] = k[-1].bfloat16().float(), v[-1].bfloat16().float()
    expect = _dense_attention(q[-1:], kmix, vmix, 0.125)
    assert torch.allclose(out[-1:], expect, atol=1e-5)
    assert not torch.allclose(out[-1:], _dense_attention(q[-1:], k, v, 0.125), atol=1e-3)
