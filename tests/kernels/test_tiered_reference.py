"""The tiered row codec and pages against hand computations."""

import pytest
import torch

from vllm_kvq.kernels.oscar import reference as oscar
from vllm_kvq.kernels.tiered import reference as ref
from vllm_kvq.kernels.tiered.format import TieredFormat

K_TIERS = ((48, 4), (80, 2))
V_TIERS = ((16, 4), (48, 2), (64, 0))


def fmt(block=16, sink=4, window=8):
    return TieredFormat(head_size=128, group_size=128, block_size=block, sink=sink, window=window,
                        k_tiers=K_TIERS, v_tiers=V_TIERS)


def test_worked_size():
    f = fmt(block=128, sink=64, window=256)
    assert f.bytes_per_token == 80  # 24 + 20 + 8 + 12 code bytes, 4 fp16 pairs
    assert 8 * f.bytes_per_token / 256 == 2.5
    assert (f.state_rows_per_block, f.state_blocks) == (20, 16)
    assert (f.v_codes_offset, f.k_pairs_offset, f.v_pairs_offset) == (44, 64, 72)


@pytest.mark.parametrize("tiers, message", [
    (((48, 4), (72, 2)), "sum to 120, not head_dim 128"),
    (((48, 3), (80, 2)), "bits must be one of"),
    (((44, 4), (84, 2)), "multiples of 8"),
])
def test_bad_tiers(tiers, message):
    with pytest.raises(ValueError, match=message):
        TieredFormat(head_size=128, group_size=128, block_size=16, sink=4, window=8, k_tiers=tiers, v_tiers=V_TIERS)


def _by_hand(seg, bits, clip):
    """One tier, element by element: clip (INT2), min-max levels with fp16 pair."""
    if bits == 2:
        seg = oscar.clip_rows(seg, clip)
    levels = 2 ** bits - 1
    lo, hi = seg.min().item(), seg.max().item()
    scale = torch.tensor(max((hi - lo) / levels, 1e-8)).half().float().item()
    lo16 = torch.tensor(lo).half().float().item()
    return torch.tensor([min(max(int((x - lo16) / scale + 0.5), 0), levels) * scale + lo16 for x in seg.tolist()])


def test_codec_matches_hand_computation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 128, generator=gen) * torch.linspace(3, 0.1, 128)
    fill = torch.randn(2, 64, generator=gen)
    codes, pairs = ref.quantize_tiers(x, V_TIERS, 0.92)
    assert codes.shape == (3, 2, 20) and pairs.shape == (3, 2, 2, 2) and pairs.dtype == torch.float16
    got = ref.dequantize_tiers(codes, pairs, V_TIERS, fill)
    for t in range(3):
        for h in range(2):
            assert torch.allclose(got[t, h, :16], _by_hand(x[t, h, :16], 4, 0.92), atol=1e-6)
            assert torch.allclose(got[t, h, 16:64], _by_hand(x[t, h, 16:64], 2, 0.92), atol=1e-6)
            assert torch.equal(got[t, h, 64:], fill[h])


def test_int4_packing_is_halved():
    x = torch.cat((torch.arange(48.0) % 16, torch.zeros(80)))[None]  # codes 0..15 twice, lo 0, scale 1
    x[0, 48:] = torch.arange(80.0) % 4
    codes, _ = ref.quantize_tiers(x, K_TIERS, 1.0)
    assert codes[0, 0].item() == (0 | (8 << 4))  # element 0 low, element 24 high
    assert codes[0, 1].item() == (1 | (9 << 4))
    # INT2 tier: quartered as OSCAR's pack_codes, starting at byte 24
    assert codes[0, 24].item() == (0 | (0 << 2) | (0 << 4) | (0 << 6))
    assert codes[0, 25].item() == (1 | (1 << 2) | (1 << 4) | (1 << 6))


def test_pages_round_trip_and_chunking():
    """Rows written in chunks read back as the codec says; attention over them
    equals the one-shot mixed attention of the same rows (decode regime)."""
    f = fmt()
    gen = torch.Generator().manual_seed(1)
    n, h, hq = 40, 2, 4
    q = torch.randn(n, hq, 128, generator=gen)
    k = torch.randn(n, h, 128, generator=gen)
    v = torch.randn(n, h, 128, generator=gen)
    fills = {"k": None, "v": torch.randn(h, 64, generator=gen)}
    blocks = f.state_blocks + -(-n // f.block_size)
    row = torch.randperm(blocks + 2, generator=gen)[:blocks] + 1
    cache = torch.zeros(blocks + 4, h, f.block_size, f.bytes_per_token, dtype=torch.uint8)
    pages = ref.TieredPages(cache, f)
    outs, at = [], 0
    for size in (7, 1, 1, 16, 15):
        outs.append(ref.attend_and_write(pages, f, row, at, q[at:at + size], k[at:at + size], v[at:at + size],
                                         0.96, 0.92, 0.1, fills["k"], fills["v"]))
        at += size
    got = torch.cat(outs)
    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    k_lo = ref.dequantize_tiers(*ref.quantize_tiers(kb, K_TIERS, 0.96), K_TIERS, None)
    v_lo = ref.dequantize_tiers(*ref.quantize_tiers(vb, V_TIERS, 0.92), V_TIERS, fills["v"])
    want = oscar.mixed_attention(q, torch.arange(n), kb, vb, k_lo, v_lo, f.sink, f.window, 0.1)
    assert torch.allclose(got, want, atol=1e-5)
    k_q, v_q, k_hi, v_hi, has = ref.read_context(pages, f, row, n, None, fills["v"])
    assert torch.equal(k_q, k_lo) and torch.equal(v_q, v_lo)
    assert has.tolist() == [p < f.sink or p >= n - f.window for p in range(n)]
    assert torch.equal(k_hi[has], kb[has]) and torch.equal(v_hi[has], vb[has])
