"""The OSCAR Triton kernels against the reference ops, for several tier plans:
INT2 everywhere (OSCAR INT2), INT4 + INT2 + not-stored tiers, and at head
size 128 the default 80-byte and the 72-byte plans.

Without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set
below before Triton compiles anything) at small shapes; on a GPU the same tests
run compiled, and ``OSCAR_REAL_SHAPES=1`` adds the serving shapes (D = 128,
block 128, sink 64, window 256).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tests.kernels import compiled_without_gpu  # noqa: E402
from vllm_kvq.kernels.oscar import reference as ref  # noqa: E402
from vllm_kvq.kernels.oscar.format import LayerTiers, OscarFormat  # noqa: E402
from vllm_kvq.kernels.oscar.triton_decode import decode_attention  # noqa: E402
from vllm_kvq.kernels.oscar.triton_store import rotation_parts, store_decode_tokens, store_tokens  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INT2, MIXED, ZERO_K = "k=64x2;v=64x2", "k=16x4,48x2;v=16x4,16x2,32x0", "k=48x2,16x0;v=32x4,32x0"
PLAN_80B, PLAN_72B = "k=48x4,80x2;v=48x4,80x0", "k=32x4,96x2;v=16x4,32x2,80x0"
SMALL = dict(d=64, hkv=2, group=4, tiers=INT2, kb=16, sink=4, window=8)
REAL = dict(d=128, hkv=8, group=4, tiers="k=128x2;v=128x2", kb=128, sink=64, window=256)
SHAPES = [SMALL, dict(SMALL, tiers=MIXED), dict(SMALL, tiers=ZERO_K), dict(SMALL, d=128, tiers=PLAN_80B),
          dict(SMALL, d=128, tiers=PLAN_72B)]
if DEV == "cuda" and os.environ.get("OSCAR_REAL_SHAPES"):
    SHAPES += [REAL, dict(REAL, tiers=PLAN_80B), dict(REAL, tiers=PLAN_72B)]
# decode also takes a group that is not a power of two, a sink + window over
# several BF16 programs, a group wider than 8 (N = 16, 64-token steps) and a
# block that is not a power of two (one 64-token step a page, its last 16 rows masked)
DECODE_SHAPES = SHAPES + [dict(SMALL, group=3, window=24), dict(SMALL, tiers=MIXED, group=12),
                          dict(SMALL, tiers=MIXED, kb=48), dict(SMALL, d=256, tiers="k=256x2;v=256x2")]
# decode launches: the default, and on a GPU other step sizes, stage counts, warps and
# BF16 rows per program
DECODE_LAUNCHES = [None]
if DEV == "cuda":
    DECODE_LAUNCHES += [{"num_warps": 2, "num_stages": 5, "tile": 64}, {"num_warps": 1, "num_stages": 3, "tile": 64},
                        {"num_warps": 1, "num_stages": 5, "tile": 32}, {"num_warps": 1, "num_stages": 2, "tile": 16},
                        {"num_warps": 4, "num_stages": 5, "tile": 128}, {"num_warps": 1, "num_stages": 8, "bf16_rows": 16},
                        {"num_warps": 1, "num_stages": 4, "tile": 128, "bf16_rows": 64}]


def _id(s):
    return f"D{s['d']}-{s['tiers'].replace(';', '-')}-KB{s['kb']}"


def _fmt(s):
    return OscarFormat(head_size=s["d"], block_size=s["kb"], sink=s["sink"], window=s["window"],
                       tiers=LayerTiers.parse(s["tiers"]))


def _fills(fmt, h, gen):
    """Calibrated means of the 0-bit tiers (random here), K and V."""
    return tuple(torch.randn(h, getattr(fmt, kind).zero, generator=gen).to(DEV) if getattr(fmt, kind).zero
                 else None for kind in "kv")


def _quantized(fmt, k, v):
    return ref.quantize(k, fmt.k, 0.96), ref.quantize(v, fmt.v, 0.92)


def _block_table(fmt, lengths, gen):
    """Disjoint shuffled blocks per request (state blocks first), as vLLM hands them out."""
    need = [fmt.state_blocks + -(-n // fmt.block_size) for n in lengths]
    perm = torch.randperm(sum(need) + 3, generator=gen)[: sum(need)] + 1
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    return table, int(perm.max()) + 1


PAD_BYTE = 0xA5
_padded_blocks = []  # (raw blocks, bytes in use) of every padded cache made, for their padding's check


def _pages(nblocks, h, fmt, padded=False):
    """A layer's zeroed pages; ``padded``: each block spaced as a BF16 page of
    the same heads (vLLM's layout when a draft model's BF16 layers share the
    pool), the bytes between blocks set to PAD_BYTE."""
    used = h * fmt.block_bytes
    if not padded:
        return torch.zeros(nblocks, h, fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8, device=DEV)
    raw = torch.full((nblocks, h * fmt.block_size * 4 * fmt.head_size), PAD_BYTE, dtype=torch.uint8, device=DEV)
    _padded_blocks.append((raw, used))
    return raw[:, :used].zero_().view(nblocks, h, fmt.block_size, fmt.bytes_per_token)


def _random_rotation(h, d, gen):
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))
    return q.float()


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("rotate", [False, True])
def test_store_matches_reference(shape, rotate, padded=False):
    """A batch of chunks from three requests (prefill, middle chunk, decode)."""
    gen = torch.Generator().manual_seed(0)
    fmt = _fmt(shape)
    h, d = shape["hkv"], shape["d"]
    # (context already stored, new tokens) per request
    steps = [(0, 3 * fmt.block_size + 5), (2 * fmt.block_size + 3, 40), (5 * fmt.block_size + 1, 1)]
    table, nblocks = _block_table(fmt, [c + t for c, t in steps], gen)
    k = (torch.randn(sum(t for _, t in steps), h, d, generator=gen) * 2).to(torch.bfloat16)
    v = torch.randn(k.shape, generator=gen).to(torch.bfloat16)
    rot = _random_rotation(h, d, gen) if rotate else None

    got = _pages(nblocks, h, fmt, padded)
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    pos = [p for ctx, t in steps for p in range(ctx, ctx + t)]
    req = [i for i, (_, t) in enumerate(steps) for _ in range(t)]
    end = [ctx + t for ctx, t in steps for _ in range(t)]
    k_out = store_tokens(got, fmt, k.to(DEV), v.to(DEV), rotation_parts(rot).to(DEV) if rotate else None, ints(pos),
                         ints(req), ints(end), table.to(DEV), 0.96, 0.92).float().cpu()
    if rotate:
        # Rotated rows agree to bf16 rounding (sums run in another order; the
        # interpreter also truncates where the GPU rounds to nearest) ...
        k_rot = torch.einsum("thd,hde->the", k.float(), rot)
        assert (k_out - k_rot).abs().max() <= k_rot.abs().max() * 2**-7
    else:
        assert torch.equal(k_out, k.float())
    # ... and the pages hold exactly what the reference makes of those rows.
    want = torch.zeros(got.shape, dtype=torch.uint8)
    pages = ref.PageViews(want, fmt)
    at = 0
    for i, (ctx, t) in enumerate(steps):
        kb, vb = k_out[at : at + t], v[at : at + t].float()
        ref.write_request(pages, fmt, table[i], ctx, kb, vb, *_quantized(fmt, kb, vb))
        at += t
    assert torch.equal(got.cpu(), want)


HYBRID_BLOCKS = [dict(SMALL, kb=48), dict(SMALL, tiers=MIXED, kb=48, sink=0), dict(SMALL, d=128, tiers=PLAN_80B, kb=80)]
HYBRID_IDS = ["D64-KB48", "D64-KB48-nosink", "D128-KB80"]


@pytest.mark.parametrize("shape", HYBRID_BLOCKS, ids=HYBRID_IDS)
def test_store_hybrid_blocks(shape):
    """The store at block sizes no power of two divides (a hybrid model's)."""
    test_store_matches_reference(shape, False)


@pytest.mark.parametrize("plan", [INT2, MIXED])
@pytest.mark.parametrize("clips", [(1.0, 0.5), (0.99, 0.0), (0.9, 0.97)])
def test_store_clip_ties(clips, plan):
    """The clip threshold under heavy ties, zeros and signed zeros, no clip
    (ratio 1), the largest entry (ratio 0) and the row maximum kept: the pages
    equal the reference's (a sort) bit for bit."""
    gen = torch.Generator().manual_seed(3)
    fmt = _fmt(dict(SMALL, tiers=plan))
    h, d = SMALL["hkv"], SMALL["d"]
    n = 2 * fmt.block_size + 3
    table, nblocks = _block_table(fmt, [n], gen)
    # few distinct magnitudes: most order statistics are tied
    k = (torch.randint(-3, 4, (n, h, d), generator=gen) * 0.25).to(torch.bfloat16)
    v = (torch.randint(-2, 3, (n, h, d), generator=gen).float() * torch.rand(n, h, 1, generator=gen)).to(torch.bfloat16)
    k[::5] = -0.0
    got = torch.zeros(nblocks, h, fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8, device=DEV)
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    store_tokens(got, fmt, k.to(DEV), v.to(DEV), None, ints(list(range(n))), ints([0] * n), ints([n] * n),
                 table.to(DEV), *clips)
    want = torch.zeros(got.shape, dtype=torch.uint8)
    kf, vf = k.float(), v.float()
    ref.write_request(ref.PageViews(want, fmt), fmt, table[0], 0, kf, vf,
                      ref.quantize(kf, fmt.k, clips[0]), ref.quantize(vf, fmt.v, clips[1]))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("plan", [INT2, MIXED])
@pytest.mark.parametrize("clips", [(0.96, 0.92), (0.5, 0.75)])
def test_store_clip_outliers(clips, plan):
    """Rows whose clip threshold lies far below their largest entry (one
    outlier 2^10 above the rest: the search leaves the octave below the
    maximum and takes all 15 bits) among ordinary rows in the same tiles,
    for K and for V: the pages equal the reference's bit for bit."""
    gen = torch.Generator().manual_seed(5)
    fmt = _fmt(dict(SMALL, tiers=plan))
    h, d = SMALL["hkv"], SMALL["d"]
    n = 2 * fmt.block_size + 7
    table, nblocks = _block_table(fmt, [n], gen)
    k = torch.randn(n, h, d, generator=gen)
    v = torch.randn(n, h, d, generator=gen)
    for x, every in ((k, 3), (v, 4)):
        rows = torch.arange(0, n, every)
        x[rows, :, torch.randint(0, d, (len(rows),), generator=gen)] *= 1024.0
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    kf, vf = k.float(), v.float()
    for x, clip, tier in ((kf, clips[0], fmt.k), (vf, clips[1], fmt.v)):  # the data does reach the 15-bit search
        x2 = x[..., tier.int4: tier.int4 + tier.int2]
        thr = x2.abs().sort(dim=-1).values[..., min(int(clip * tier.int2), tier.int2 - 1)]
        assert bool((thr < x2.abs().amax(-1) / 2).any())
    got = torch.zeros(nblocks, h, fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8, device=DEV)
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    store_tokens(got, fmt, k.to(DEV), v.to(DEV), None, ints(list(range(n))), ints([0] * n), ints([n] * n),
                 table.to(DEV), *clips)
    want = torch.zeros(got.shape, dtype=torch.uint8)
    ref.write_request(ref.PageViews(want, fmt), fmt, table[0], 0, kf, vf,
                      ref.quantize(kf, fmt.k, clips[0]), ref.quantize(vf, fmt.v, clips[1]))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_store_keys_not_bf16(dtype):
    """fp16/fp32 keys (models served in those dtypes) are rotated in fp32 and
    rounded to bf16 once, as the reference does; values are rounded to bf16."""
    gen = torch.Generator().manual_seed(6)
    fmt = _fmt(SMALL)
    h, d = SMALL["hkv"], SMALL["d"]
    n = fmt.block_size + 3
    table, nblocks = _block_table(fmt, [n], gen)
    k = (torch.randn(n, h, d, generator=gen) * 3).to(dtype)
    v = torch.randn(n, h, d, generator=gen).to(dtype)
    rot = _random_rotation(h, d, gen)
    got = torch.zeros(nblocks, h, fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8, device=DEV)
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    k_out = store_tokens(got, fmt, k.to(DEV), v.to(DEV), rotation_parts(rot).to(DEV), ints(list(range(n))),
                         ints([0] * n), ints([n] * n), table.to(DEV), 0.96, 0.92).cpu()
    k_rot = torch.einsum("thd,hde->the", k.float(), rot).to(torch.bfloat16)
    assert (k_out.float() - k_rot.float()).abs().max() <= k_rot.float().abs().max() * 2**-7
    # rounded once: keys rounded to bf16 before the rotation differ in ~40% of entries
    assert (k_out != k_rot).float().mean() <= 0.01
    want = torch.zeros(got.shape, dtype=torch.uint8)
    kb, vb = k_out.float(), v.to(torch.bfloat16).float()
    ref.write_request(ref.PageViews(want, fmt), fmt, table[0], 0, kb, vb, *_quantized(fmt, kb, vb))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: f"{_id(s)}-group{s['group']}-W{s['window']}")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("launch", DECODE_LAUNCHES)
def test_decode_matches_reference(shape, splits, launch, padded=False):
    """Requests shorter than, equal to and far beyond sink + window, one of
    them with its INT2 range ending exactly at a page's end."""
    gen = torch.Generator().manual_seed(1)
    fmt = _fmt(shape)
    h, d, hq = shape["hkv"], shape["d"], shape["hkv"] * shape["group"]
    s0w = fmt.sink + fmt.window
    lengths = [1, s0w - 1, s0w, s0w + 1, 6 * fmt.block_size + 7, fmt.window + 4 * fmt.block_size]
    if shape["d"] == 128 and DEV == "cuda":  # a long context (minutes in the interpreter)
        lengths.append(20_000)
    table, nblocks = _block_table(fmt, lengths, gen)
    cache = _pages(nblocks, h, fmt, padded)
    pages = ref.PageViews(cache, fmt)
    tdev = table.to(DEV)
    fills = _fills(fmt, h, gen)
    q_last, want = [], []
    for i, n in enumerate(lengths):
        k = torch.randn(n, h, d, generator=gen, device="cpu").to(DEV)
        v = torch.randn(n, h, d, generator=gen, device="cpu").to(DEV)
        q = torch.randn(n, hq, d, generator=gen, device="cpu").to(DEV)
        chunk = min(max((n - 1) // 2, 1), 1024)  # the context in chunks (bounded reference memory)
        for c in range(0, n - 1, chunk):
            e = min(c + chunk, n - 1)
            ref.attend_and_write(pages, fmt, tdev[i], c, q[c:e], k[c:e], v[c:e], 0.96, 0.92, d ** -0.5, fills)
        want.append(ref.attend_and_write(pages, fmt, tdev[i], n - 1, q[-1:], k[-1:], v[-1:], 0.96, 0.92,
                                         d ** -0.5, fills)[0])
        q_last.append(q[-1])
    out = torch.empty(len(lengths), hq, d, dtype=torch.float32, device=DEV)
    decode_attention(torch.stack(q_last), cache, fmt, tdev, torch.tensor(lengths, dtype=torch.int32, device=DEV),
                     d ** -0.5, splits, out, launch, fills)
    want = torch.stack(want)
    err = (out - want).abs().max().item()
    print(f"max |triton - reference| {err:.2e}, mean {(out - want).abs().mean().item():.2e}")
    # q, scaled probabilities and BF16 rows pass through fp16 for the tensor cores.
    assert err < 5e-3, err
    assert (out - want).abs().mean().item() < 5e-4


@pytest.mark.parametrize("shape", SHAPES[:3], ids=_id)
@pytest.mark.parametrize("store", ["decode", "tokens"])
def test_padded_decode_batch(shape, store):
    """A decode batch as vLLM replays it from a CUDA graph: the live requests,
    then the rows it pads the batch with (length 0, slot -1, block-table row
    NULL = block 0, or a stale row of a live request), and a dummy-run row
    (length 1, NULL row, slot -1). Over cache bytes that start random (freed
    blocks keep old bytes): the pages end up exactly as the reference leaves
    them after the live tokens alone, the live rows' outputs match the
    reference and the length-0 rows get zeros."""
    gen = torch.Generator().manual_seed(4)
    fmt = _fmt(shape)
    h, d, hq = shape["hkv"], shape["d"], shape["hkv"] * shape["group"]
    s0w = fmt.sink + fmt.window
    lengths = [1, fmt.sink + 1, s0w + 1, 3 * fmt.block_size + 5]
    live = len(lengths)
    table, nblocks = _block_table(fmt, lengths, gen)
    # padding: NULL row, a stale copy of request 2's row, and a dummy-run row
    table = torch.cat([table, torch.zeros(1, table.shape[1], dtype=torch.int32), table[2:3],
                       torch.zeros(1, table.shape[1], dtype=torch.int32)])
    seq_lens = lengths + [0, 0, 1]
    slots = [1] * live + [-1, -1, -1]
    cache = torch.randint(0, 256, (nblocks, h, fmt.block_size, fmt.bytes_per_token), generator=gen,
                          dtype=torch.uint8).to(DEV)
    pages = ref.PageViews(cache, fmt)
    tdev = table.to(DEV)
    fills = _fills(fmt, h, gen)
    q_last, k_last, v_last = [], [], []
    for i, n in enumerate(lengths):
        k = torch.randn(n, h, d, generator=gen).to(torch.bfloat16).float().to(DEV)
        v = torch.randn(n, h, d, generator=gen).to(torch.bfloat16).float().to(DEV)
        q = torch.randn(n, hq, d, generator=gen).to(DEV)
        if n > 1:  # the context, as earlier steps wrote it
            ref.attend_and_write(pages, fmt, tdev[i], 0, q[:-1], k[:-1], v[:-1], 0.96, 0.92, d ** -0.5, fills)
        q_last.append(q[-1])
        k_last.append(k[-1])
        v_last.append(v[-1])
    for _ in range(len(seq_lens) - live):  # what the padded rows hold: whatever
        q_last.append(torch.randn(hq, d, generator=gen).to(DEV))
        k_last.append(torch.randn(h, d, generator=gen).to(torch.bfloat16).float().to(DEV))
        v_last.append(torch.randn(h, d, generator=gen).to(torch.bfloat16).float().to(DEV))
    want_cache = cache.clone()
    want_pages = ref.PageViews(want_cache, fmt)
    want = torch.stack([ref.attend_and_write(want_pages, fmt, tdev[i], n - 1, q_last[i][None], k_last[i][None],
                                             v_last[i][None], 0.96, 0.92, d ** -0.5, fills)[0]
                        for i, n in enumerate(lengths)])

    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    q, k, v = torch.stack(q_last), torch.stack(k_last), torch.stack(v_last)
    seq = ints(seq_lens)
    if store == "decode":
        store_decode_tokens(cache, fmt, k, v, None, seq, tdev, 0.96, 0.92,
                            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV))
    else:  # explicit index: the padding at position -1
        pos = [n - 1 if s >= 0 else -1 for n, s in zip(seq_lens, slots)]
        store_tokens(cache, fmt, k, v, None, ints(pos), ints(list(range(len(seq_lens)))), seq, tdev, 0.96, 0.92)
    changed = (cache.cpu() != want_cache.cpu()).sum().item()
    assert changed == 0, f"{changed} cache bytes differ from the reference's"

    out = torch.full((len(seq_lens), hq, d), float("nan"), dtype=torch.float32, device=DEV)
    decode_attention(q, cache, fmt, tdev, seq, d ** -0.5, 3, out, fills=fills)
    err = (out[:live] - want).abs().max().item()
    assert err < 5e-3, err
    assert torch.equal(out[live:live + 2].cpu(), torch.zeros(2, hq, d))


@pytest.mark.parametrize("plan", [INT2, MIXED])
def test_blocks_padded_to_a_larger_page(plan):
    """vLLM pads a page to the pool's largest when that is no whole multiple
    of it, and a layer's blocks then lie further apart than its H pages. Store, decode and extend address blocks by the tensor's stride:
    each matches the reference, and the bytes between blocks stay untouched."""
    _padded_blocks.clear()
    shape = dict(SMALL, tiers=plan)
    test_store_matches_reference(shape, rotate=True, padded=True)
    test_decode_matches_reference(shape, splits=3, launch=None, padded=True)
    test_extend_matches_reference(shape, padded=True)
    assert len(_padded_blocks) == 3
    for raw, used in _padded_blocks:
        assert bool((raw[:, used:] == PAD_BYTE).all())


@pytest.mark.parametrize("plan", [INT2, MIXED])
def test_decode_sub_page_steps(plan):
    """Steps of half a page (two per block), as the one- and two-warp launches take them."""
    test_decode_matches_reference(dict(SMALL, tiers=plan, kb=32), 3, {"num_warps": 2, "num_stages": 2, "tile": 16})


def _record_launches(monkeypatch, module, kernel: str, key: str) -> list:
    """Wrap ``module.kernel`` so that each launch appends its ``key`` constexpr
    to the returned list, then runs as before."""
    launched, jit = [], getattr(module, kernel)

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launched.append(kw[key])
                return jit[grid](*args, **kw)
            return run

    monkeypatch.setattr(module, kernel, Recorder())
    return launched


@pytest.mark.parametrize("tile", [32, 16])
def test_decode_partial_steps(tile, monkeypatch):
    """48-token blocks in 32-token steps: each page's second step is partial
    (16 rows inside, 16 masked); in 16-token steps none is. The kernel must
    get the asked step, not one that divides the block."""
    from vllm_kvq.kernels.oscar import triton_decode

    launched = _record_launches(monkeypatch, triton_decode, "_decode_kernel", "TILE")
    test_decode_matches_reference(dict(SMALL, kb=48), 3, {"tile": tile})
    assert launched == [tile]


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_extend_matches_reference(shape, launch=None, padded=False):
    """One batch of chunks: a first prefill, chunks that start inside the sink,
    inside the window and far beyond it, shorter and longer than W; then the
    pages after store (INT2) -> extend -> store (BF16) equal the reference's."""
    from vllm_kvq.kernels.oscar.triton_extend import extend_attention, query_tiles

    gen = torch.Generator().manual_seed(2)
    fmt = _fmt(shape)
    h, d, hq = shape["hkv"], shape["d"], shape["hkv"] * shape["group"]
    w, s0 = fmt.window, fmt.sink
    steps = [(0, 3 * w + 5), (max(s0 - 2, 0), 5), (s0 + w // 2, 2 * w + 3), (4 * fmt.block_size + 3, w - 1),
             (4 * fmt.block_size + 3, 1)]
    if shape["window"] == REAL["window"]:  # the serving shapes: a chunk far into a long context too
        steps += [(9000, 700)]
    table, nblocks = _block_table(fmt, [c + t for c, t in steps], gen)
    tdev = table.to(DEV)
    cache = _pages(nblocks, h, fmt, padded)
    pages = ref.PageViews(cache, fmt)
    scale = d ** -0.5
    fills = _fills(fmt, h, gen)
    q_all, k_all, v_all = [], [], []
    for i, (ctx, t) in enumerate(steps):
        k = torch.randn(ctx + t, h, d, generator=gen).to(torch.bfloat16).to(DEV)
        v = torch.randn(ctx + t, h, d, generator=gen).to(torch.bfloat16).to(DEV)
        q = torch.randn(ctx + t, hq, d, generator=gen).to(DEV)
        for c in range(0, ctx, 1024):  # the context, as earlier steps wrote it
            e = min(c + 1024, ctx)
            ref.attend_and_write(pages, fmt, tdev[i], c, q[c:e], k[c:e], v[c:e], 0.96, 0.92, scale, fills)
        q_all.append(q[ctx:])
        k_all.append(k[ctx:])
        v_all.append(v[ctx:])
    q, k, v = torch.cat(q_all), torch.cat(k_all), torch.cat(v_all)

    want_cache = cache.clone()
    want_pages = ref.PageViews(want_cache, fmt)
    want, at = [], 0
    for i, (ctx, t) in enumerate(steps):
        want.append(ref.attend_and_write(want_pages, fmt, tdev[i], ctx, q[at:at + t], k[at:at + t], v[at:at + t],
                                         0.96, 0.92, scale, fills))
        at += t
    want = torch.cat(want)

    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    pos = ints([p for ctx, t in steps for p in range(ctx, ctx + t)])
    req = ints([i for i, (_, t) in enumerate(steps) for _ in range(t)])
    end = ints([ctx + t for ctx, t in steps for _ in range(t)])
    firsts = [sum(t for _, t in steps[:i]) for i in range(len(steps))]
    tiles = query_tiles([(i, firsts[i], t, ctx) for i, (ctx, t) in enumerate(steps)], DEV)
    out = torch.empty(q.shape, dtype=torch.float32, device=DEV)
    store_tokens(cache, fmt, k, v, None, pos, req, end, tdev, 0.96, 0.92, state=False)
    extend_attention(q, k, v, cache, fmt, tdev, tiles, scale, out, launch, fills)
    store_tokens(cache, fmt, k, v, None, pos, req, end, tdev, 0.96, 0.92, data=False)
    err = (out - want).abs().max().item()
    print(f"max |triton - reference| {err:.2e}, mean {(out - want).abs().mean().item():.2e}")
    assert err < 5e-3 and (out - want).abs().mean().item() < 5e-4
    assert torch.equal(cache.cpu(), want_cache.cpu())


@pytest.mark.parametrize("launch", [None, {"rows": 16, "block_n": 32, "num_warps": 4}])
def test_extend_head_blocks(launch):
    """Six query heads per KV head: two programs of four heads each (the second
    half masked), or six of one head."""
    test_extend_matches_reference(dict(SMALL, group=6), launch)


def test_extend_head_size_256():
    """Head size 256 (Qwen3-Next's attention): half the query rows and key tile."""
    test_extend_matches_reference(dict(SMALL, d=256, tiers="k=256x2;v=256x2"))


@pytest.mark.parametrize("shape", HYBRID_BLOCKS, ids=HYBRID_IDS)
def test_extend_partial_tiles(shape, monkeypatch):
    """Blocks that no power of two past 16 divides (a hybrid model's blocks are
    sized by its state pages): a page's last INT2 key tile is partial (32-key
    tiles through 48-token blocks, 64-key tiles through 80-token ones), with
    and without a sink. The kernel must get that tile, not one that divides
    the block."""
    from vllm_kvq.kernels.oscar import triton_extend

    launched = _record_launches(monkeypatch, triton_extend, "_extend_kernel", "BLOCK_N")
    test_extend_matches_reference(shape, {"block_n": 64})
    assert launched == [shape["d"] // 2]


def test_extend_head_size_64_tiles(monkeypatch):
    """Head size 64 in 64-token blocks takes 32-key tiles (:func:`key_tile`;
    64-key tiles there gave wrong outputs compiled for the H200)."""
    from vllm_kvq.kernels.oscar import triton_extend

    launched = _record_launches(monkeypatch, triton_extend, "_extend_kernel", "BLOCK_N")
    test_extend_matches_reference(dict(SMALL, kb=64))
    assert launched == [32]


# (query tokens a request, rows kept, path) of each step: a verification step
# of 1 + k tokens keeps the accepted drafts plus one, the rest are rejected
# and rewritten by the next step; a step with fewer tokens (fewer drafts
# proposed) leaves rejected rows in the ring's spare slots; the chunk path
# (store INT2, extend, store BF16) serves requests of a non-uniform batch.
SPEC_STEPS = [(4, 2, "decode"), (1, 1, "decode"), (4, 1, "chunk"), (3, 3, "decode")]


@pytest.mark.parametrize("plan", [INT2, MIXED])
def test_speculative_steps_match_reference(plan):
    """Verification steps with k = 3 drafts over a ring of W + 3 slots, one
    request inside the sink and one past sink + window: each query row of
    the multi-token decode (its own window edge) matches attention computed
    from the kept rows alone (no pages, no ring), and the pages equal the
    reference ops' after every step."""
    import dataclasses

    from vllm_kvq.kernels.oscar.triton_extend import extend_attention, query_tiles

    drafts = 3
    gen = torch.Generator().manual_seed(7)
    shape = dict(SMALL, tiers=plan, hkv=1)
    fmt = dataclasses.replace(_fmt(shape), ring_slack=drafts)
    assert fmt.ring == fmt.window + drafts
    h, d, hq = shape["hkv"], shape["d"], shape["hkv"] * shape["group"]
    scale, clips = d ** -0.5, (0.96, 0.92)
    starts = [3, 2 * fmt.block_size + 5]
    total = [s + sum(q for q, _, _ in SPEC_STEPS) for s in starts]
    table, nblocks = _block_table(fmt, total, gen)
    tdev = table.to(DEV)
    fills = _fills(fmt, h, gen)
    bf16 = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16).float().to(DEV)  # noqa: E731
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731

    cache = torch.zeros(nblocks, h, fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8, device=DEV)
    kept_k, kept_v = [], []
    for i, n in enumerate(starts):  # the context, as earlier steps wrote it
        kept_k.append(bf16(n, h, d))
        kept_v.append(bf16(n, h, d))
        ref.attend_and_write(ref.PageViews(cache, fmt), fmt, tdev[i], 0, bf16(n, hq, d), kept_k[i], kept_v[i],
                             *clips, scale, fills)
    want_cache = cache.clone()
    for ql, keep, path in SPEC_STEPS:
        q, k, v = bf16(len(starts) * ql, hq, d), bf16(len(starts) * ql, h, d), bf16(len(starts) * ql, h, d)
        lengths = [len(x) for x in kept_k]
        want = []
        for i, n in enumerate(lengths):
            rows = slice(i * ql, (i + 1) * ql)
            hist_k, hist_v = torch.cat((kept_k[i], k[rows])), torch.cat((kept_v[i], v[rows]))
            lo_k = ref.dequantize(*ref.quantize(hist_k, fmt.k, clips[0]), fmt.k, fills[0])
            lo_v = ref.dequantize(*ref.quantize(hist_v, fmt.v, clips[1]), fmt.v, fills[1])
            want.append(ref.mixed_attention(q[rows], torch.arange(n, n + ql, device=DEV), hist_k, hist_v, lo_k, lo_v,
                                            fmt.sink, fmt.window, scale))
            ref.attend_and_write(ref.PageViews(want_cache, fmt), fmt, tdev[i], n, q[rows], k[rows], v[rows], *clips,
                                 scale, fills)
        want = torch.cat(want)
        seq = ints([n + ql for n in lengths])
        out = torch.empty(q.shape, dtype=torch.float32, device=DEV)
        if path == "decode":
            store_decode_tokens(cache, fmt, k, v, None, seq, tdev, *clips, query_len=ql)
            decode_attention(q, cache, fmt, tdev, seq, scale, 1, out, fills=fills, query_len=ql)
        else:
            idx = (ints([p for n in lengths for p in range(n, n + ql)]), ints([i for i in range(len(starts))
                                                                                for _ in range(ql)]),
                   ints([n + ql for n in lengths for _ in range(ql)]), tdev, *clips)
            store_tokens(cache, fmt, k, v, None, *idx, state=False)
            extend_attention(q, k, v, cache, fmt, tdev, query_tiles([(i, i * ql, ql, n) for i, n in enumerate(lengths)],
                                                                     DEV), scale, out, fills=fills)
            store_tokens(cache, fmt, k, v, None, *idx, data=False)
        err = (out - want).abs()
        assert err.max().item() < 5e-3 and err.mean().item() < 5e-4, (ql, keep, path, err.max().item())
        assert torch.equal(cache.cpu(), want_cache.cpu()), (ql, keep, path)
        for i in range(len(starts)):
            rows = slice(i * ql, i * ql + keep)
            kept_k[i], kept_v[i] = torch.cat((kept_k[i], k[rows])), torch.cat((kept_v[i], v[rows]))


def test_multi_token_decode_needs_the_ring():
    """More query tokens a request than the ring has spare slots for: refused."""
    fmt = _fmt(SMALL)
    q = torch.zeros(4, SMALL["hkv"] * SMALL["group"], SMALL["d"])
    with pytest.raises(ValueError, match="ring of W"):
        decode_attention(q, torch.zeros(8, SMALL["hkv"], fmt.block_size, fmt.bytes_per_token, dtype=torch.uint8),
                         fmt, torch.zeros(2, 8, dtype=torch.int32), torch.tensor([5, 5], dtype=torch.int32), 1.0, 1,
                         torch.empty_like(q), query_len=2)


SPILL_CHECK = """
import json, sys
from benchmarks.kernel_sass import HEAD_PLANS, compile_kernel, decode_job
spills = {}
for d, name in [(64, "tiers 80 B"), (128, "tiers 80 B"), (256, "tiers 80 B"), (128, "tiers 72 B"), (128, "OSCAR INT2")]:
    label, fn, const, warps, _ = decode_job(name, HEAD_PLANS[d][name], 16, d)
    const = dict(const)
    maxnreg = const.pop("MAXNREG")
    spills[label] = compile_kernel(fn, const, warps, const["NSTAGE"], maxnreg)["spill_bytes"]
print(json.dumps(spills))
"""


def test_decode_default_launch_does_not_spill():
    """The decode kernel at its default launch, compiled for sm_90a (no GPU
    needed), spills no register at the widest group (16 query heads a KV
    head) for the default tier plan at head sizes 64-256, the 72-byte plan
    and OSCAR INT2: a spill inside the loop costs several times the kernel's
    time. Compiled in a process of its own: this module runs Triton's
    interpreter."""
    spills = compiled_without_gpu(SPILL_CHECK)
    assert len(spills) == 5 and not any(spills.values()), spills
