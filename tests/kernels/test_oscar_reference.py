"""The OSCAR reference ops (the tiered row codec and its pages) against
closed-form expectations and hand computations."""

import pytest
import torch

from vllm_kvq.kernels.oscar import reference as ref
from vllm_kvq.kernels.oscar.format import LayerTiers, OscarFormat, TierError, TierPlan

TIERS = LayerTiers.parse("k=48x4,80x2;v=16x4,48x2,64x0")


def test_oscar_int2_worked_size():
    fmt = OscarFormat(head_size=128, block_size=128, sink=64, window=256)
    assert fmt.tiers == LayerTiers.parse("k=128x2;v=128x2")
    assert fmt.bytes_per_token == 72  # 2 x (32 B codes + 4 B fp16 scale/min)
    assert fmt.state_rows_per_block == 18 and fmt.state_blocks == 18
    assert (fmt.v_codes_offset, fmt.k_pairs_offset, fmt.v_pairs_offset) == (128 * 32, 128 * 64, 128 * 68)
    # 128K context: 2.25 bits for every token plus 18 state blocks.
    assert fmt.bits_per_element(131072) == pytest.approx(8 * (131072 * 72 + 18 * 128 * 72) / (256 * 131072),
                                                         rel=1e-12)


def test_tiered_worked_size():
    f = OscarFormat(head_size=128, block_size=128, sink=64, window=256, tiers=TIERS)
    assert f.bytes_per_token == 80  # 24 + 20 + 8 + 12 code bytes, 4 fp16 pairs
    assert (f.state_rows_per_block, f.state_blocks) == (20, 16)
    assert (f.v_codes_offset, f.k_pairs_offset, f.v_pairs_offset) == (128 * 44, 128 * 64, 128 * 72)


@pytest.mark.parametrize("spec, message", [
    ("k=48x4,64x2;v=128x2", "sum to 112, not the head size 128"),
    ("k=48x3,80x2;v=128x2", "bits must be 4, 2 or 0"),
    ("k=40x4,88x2;v=128x2", "multiples of 16"),
    ("k=80x2,48x4;v=128x2", "strongest first"),
    ("k=64x2,64x2;v=128x2", "one tier per width"),
    ("k=128x0;v=128x2", "nothing of the row would be stored"),
    ("k=128x2", "give both k and v"),
    ("k=48:4;v=128x2", "write WIDTHxBITS"),
])
def test_bad_tiers_name_the_fix(spec, message):
    with pytest.raises(TierError, match=message):
        LayerTiers.parse(spec).check(128)


def _by_hand(seg, bits, clip):
    """One tier element by element: clip (INT2), min-max levels with the fp16 pair."""
    if bits == 2 and clip < 1:
        thr = sorted(abs(x) for x in seg.tolist())[min(int(clip * len(seg)), len(seg) - 1)]
        seg = seg.clamp(-thr, thr)
    levels = 2 ** bits - 1
    lo, hi = seg.min().item(), seg.max().item()
    scale = torch.tensor(max((hi - lo) / levels, 1e-8)).half().float().item()
    lo16 = torch.tensor(lo).half().float().item()
    return torch.tensor([min(max(int((x - lo16) / scale + 0.5), 0), levels) * scale + lo16 for x in seg.tolist()])


def test_codec_matches_hand_computation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 128, generator=gen) * torch.linspace(3, 0.1, 128)
    fill = torch.randn(2, 64, generator=gen)
    codes, pairs = ref.quantize(x, TIERS.v, 0.92)
    assert codes.shape == (3, 2, 20) and pairs.shape == (3, 2, 2, 2) and pairs.dtype == torch.float16
    got = ref.dequantize(codes, pairs, TIERS.v, fill)
    for t in range(3):
        for h in range(2):
            assert torch.allclose(got[t, h, :16], _by_hand(x[t, h, :16], 4, 0.92), atol=1e-6)
            assert torch.allclose(got[t, h, 16:64], _by_hand(x[t, h, 16:64], 2, 0.92), atol=1e-6)
            assert torch.equal(got[t, h, 64:], fill[h])


def test_packing_is_halved_then_quartered():
    """INT4 byte b: element b low, b + w/2 high; INT2 byte b (after the INT4
    bytes): elements b, b + w/4, b + w/2, b + 3w/4 in bits 0-1 .. 6-7."""
    x = torch.zeros(1, 128)
    x[0, :48] = torch.arange(48.0) % 16  # lo 0, scale 1
    x[0, 48:] = torch.arange(80.0) % 4
    codes, _ = ref.quantize(x, TIERS.k, 1.0)
    assert codes[0, 0].item() == (0 | (8 << 4)) and codes[0, 1].item() == (1 | (9 << 4))  # elements 0/24, 1/25
    assert codes[0, 24].item() == 0 and codes[0, 25].item() == (1 | (1 << 2) | (1 << 4) | (1 << 6))
    assert codes[0, 26].item() == (2 | (2 << 2) | (2 << 4) | (2 << 6))  # elements 2, 22, 42, 62 of the tier
    rnd = torch.randint(0, 4, (7, 128), dtype=torch.uint8)
    assert torch.equal(ref.unpack_codes(ref.pack_codes(rnd, 2), 2), rnd)


def test_quantize_error_bound_and_levels():
    torch.manual_seed(0)
    x = torch.randn(64, 128) * 3
    codes, sm = ref.quantize(x, TierPlan.int2_only(128), clip=1.0)
    assert codes.shape == (64, 32) and sm.dtype == torch.float16 and sm.shape == (64, 1, 2)
    xh = ref.dequantize(codes, sm, TierPlan.int2_only(128))
    # Rounding to the nearest of 4 levels: error <= half a step (+ fp16 slack); the row's min is kept.
    assert ((xh - x).abs() <= sm[:, :, 0].float() / 2 + 1e-2).all()
    assert torch.allclose(xh.amin(-1), x.amin(-1), atol=2e-2)


def test_clip_clamps_the_top_order_statistics():
    x = torch.arange(1, 129, dtype=torch.float32).unsqueeze(0)
    c = ref.clip_rows(x, 0.96)  # idx = 122 -> threshold is the 123rd smallest |x| = 123
    assert c.max().item() == 123.0 and (c == 123.0).sum().item() == 6
    assert torch.equal(ref.clip_rows(x, 1.0), x)


def test_page_views_put_bytes_at_their_format_offsets():
    """K codes token-major, V codes byte-major, then K and V pairs per token."""
    fmt = OscarFormat(head_size=32, block_size=8, sink=0, window=0, tiers=LayerTiers.parse("k=16x4,16x2;v=32x2"))
    cache = torch.zeros(2, 3, fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8)
    pages = ref.PageViews(cache, fmt)
    pages.k_codes[1, 2, 5, 3] = 7
    pages.v_codes[1, 2, 5, 3] = 9
    pages.k_pairs[1, 2, 5, 1, 0] = 1.0  # fp16 0x3c00
    pages.v_pairs[1, 2, 5, 0, 1] = 2.0  # fp16 0x4000
    flat = cache[1, 2].flatten()
    kc = 12  # 8 INT4 + 4 INT2 bytes a row
    at = {5 * kc + 3: 7, fmt.v_codes_offset + 3 * 8 + 5: 9, fmt.k_pairs_offset + 5 * 8 + 4 + 1: 0x3C,
          fmt.v_pairs_offset + 5 * 4 + 2 + 1: 0x40}
    assert flat.nonzero().flatten().tolist() == sorted(at)
    assert all(flat[i].item() == b for i, b in at.items())


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
    fmt = OscarFormat(head_size=64, block_size=32, sink=8, window=64)
    n, h, g = 70, 2, 3
    q, k, v = torch.randn(n, h * g, 64), torch.randn(n, h, 64), torch.randn(n, h, 64)
    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    cache = _pages(fmt, 64, h)
    out = ref.attend_and_write(ref.PageViews(cache, fmt), fmt, torch.arange(1, 40), 0, q, k, v, 1.0, 1.0, 0.125)
    assert torch.allclose(out, _dense_attention(q, kb, vb, 0.125), atol=1e-5)


@pytest.mark.parametrize("spec", ["k=64x2;v=64x2", "k=16x4,48x2;v=16x4,16x2,32x0"])
def test_chunked_equals_unchunked_and_pages_match(spec):
    torch.manual_seed(2)
    fmt = OscarFormat(head_size=64, block_size=16, sink=4, window=8, tiers=LayerTiers.parse(spec))
    n, h, g = 61, 2, 2
    q, k, v = torch.randn(n, h * g, 64), torch.randn(n, h, 64), torch.randn(n, h, 64)
    fills = (None, torch.randn(h, fmt.v.zero) if fmt.v.zero else None)
    row = torch.randperm(60)[: fmt.state_blocks + 4] + 1
    whole = _pages(fmt, 64, h)
    out_whole = ref.attend_and_write(ref.PageViews(whole, fmt), fmt, row, 0, q, k, v, 0.96, 0.92, 0.125, fills)
    chunked = _pages(fmt, 64, h)
    outs, start = [], 0
    for size in (5, 1, 17, 3, 1, 34):
        outs.append(ref.attend_and_write(ref.PageViews(chunked, fmt), fmt, row, start, q[start:start + size],
                                         k[start:start + size], v[start:start + size], 0.96, 0.92, 0.125, fills))
        start += size
    assert start == n
    assert torch.allclose(torch.cat(outs), out_whole, atol=1e-5)
    # Quantized pages are bit-identical; state rows hold the sink and the last W rows.
    assert torch.equal(whole[row[fmt.state_blocks:]], chunked[row[fmt.state_blocks:]])
    state = lambda c: ref.PageViews(c, fmt).state[row[: fmt.state_blocks]]  # noqa: E731
    assert torch.equal(state(whole), state(chunked))


def test_old_keys_are_read_quantized():
    """Far from the window, the last query sees exactly the hand-dequantized
    rows (INT4 and INT2 tiers, the 0-bit tier's mean) and its own BF16 row."""
    torch.manual_seed(3)
    tiers = LayerTiers.parse("k=16x4,48x2;v=16x4,16x2,32x0")
    fmt = OscarFormat(head_size=64, block_size=16, sink=0, window=1, tiers=tiers)
    n, h = 40, 1
    q, k, v = torch.randn(n, h, 64), torch.randn(n, h, 64), torch.randn(n, h, 64)
    v_fill = torch.randn(h, 32)
    cache = _pages(fmt, 16, h)
    row = torch.arange(1, 1 + fmt.state_blocks + 3)
    out = ref.attend_and_write(ref.PageViews(cache, fmt), fmt, row, 0, q, k, v, 1.0, 1.0, 0.125, (None, v_fill))
    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    kq = torch.stack([torch.cat((_by_hand(r[:16], 4, 1.0), _by_hand(r[16:], 2, 1.0))) for r in kb[:, 0]])[:, None]
    vq = torch.stack([torch.cat((_by_hand(r[:16], 4, 1.0), _by_hand(r[16:32], 2, 1.0), v_fill[0]))
                      for r in vb[:, 0]])[:, None]
    kq[-1], vq[-1] = kb[-1], vb[-1]
    assert torch.allclose(out[-1:], _dense_attention(q[-1:], kq, vq, 0.125), atol=1e-5)
    assert not torch.allclose(out[-1:], _dense_attention(q[-1:], k, v, 0.125), atol=1e-3)
