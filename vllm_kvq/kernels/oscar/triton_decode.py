"""Split-KV OSCAR decode: the last query tokens of each request (one, or
one plus the drafts a speculative step verifies) over the quantized pages
plus the BF16 sink and window, merged by log-sum-exp.

Twin of :func:`reference.mixed_attention` for a query at position ``L - 1``
(``L`` the length up to and including it): keys ``[S0, L - W)`` are read
quantized, the sink ``[0, S0)`` and the window ``[L - W, L)`` BF16 from the
state blocks. With ``Q`` query tokens a request, query row ``i`` is request
``i // Q``'s at ``L = seq_len - (Q - 1 - i % Q)``: each row has its own
window edge, and causality follows from ``L``. The step's own rows are
stored first (``triton_store.store_decode_tokens``); the ring of ``W + k``
slots keeps every row a query of the step reads in BF16.

Grid ``(B, H, splits + bf16 programs)``: programs ``0 .. splits-1`` of a
(request, KV head) stream equal slices of its quantized range; the others
each read ``bf16_rows`` of its ``min(L, S0 + W)`` BF16 state rows. Every
program serves all query heads of its KV head (GQA: each page byte is read
once). Codes are never expanded to values in memory: with ``k = code * s + m``
per row and tier, ``q.k = sum over tiers of s (q.code) + m sum(q)``, so the
dot products run on the raw codes and each tier's scale and min are applied
to the scores (and, for values, to the probabilities). The layer's tier plan
is compile-time (:func:`pieces`). No host sync, and the split count depends
only on the batch size and static config: safe to capture in a CUDA graph. A
request of length 0 (vLLM's padding of a replayed batch) reads no page and
gets zeros.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.oscar.format import OscarFormat

LOG2E = 1.4426950408889634
# The best of the H200 sweep at head size 128 (benchmarks/results/oscar_kernels.json):
# 128-token steps while a KV head's query heads fit one 8-wide MMA tile, 64-token steps
# for wider groups. bf16_rows: state rows per BF16 program (more would set the whole
# kernel's register count).
LAUNCH = {"num_warps": 1, "num_stages": 6, "tile": 128, "bf16_rows": 32}
LIVE_LIMIT = 120
"""Most registers a thread may give the loop's live tiles (:func:`live_registers`): the
largest estimate that compiled without spills for sm_90a over OSCAR INT2 and the tier
plans of ``benchmarks/kernel_sass.py`` (head sizes 64-256, groups 1-16)."""


def live_registers(fmt: OscarFormat, group: int, tile: int, num_warps: int) -> float:
    """32-bit registers a thread holds across the decode loop for its tiles:
    the key planes' q operands (fp16, loop-invariant), the value planes'
    accumulators (fp32) and the step's scores (fp32, counted 1.5 times: the
    probabilities live beside them), with N (tiers x query heads) padded to
    the tensor cores' 8."""
    gp = triton.next_power_of_2(group)
    kn, vn = max(fmt.k.stored * gp, 8), max(fmt.v.stored * gp, 8)
    k_planes, v_planes = (sum(n * planes for _, n, planes, _ in row_pieces(t.code_bytes, t.int4 // 2))
                          for t in (fmt.k, fmt.v))
    return (k_planes * kn / 2 + v_planes * vn + 1.5 * tile * kn) / (32 * num_warps)


def default_launch(group: int, head_size: int, fmt: OscarFormat | None = None) -> dict:
    """The launch for ``group`` query heads per KV head of ``head_size``, in
    pages of ``fmt`` (OSCAR INT2 if None).

    Registers grow with the step's tokens x head size: wider groups halve the
    step, and so does each doubling of the head size past 128, as do the
    BF16 programs' rows. Where the loop's live tiles would still pass
    :data:`LIVE_LIMIT` registers a thread (wide groups, tier plans with two
    K tiers, head size 256), warps are doubled until they fit: a spill inside
    the loop costs more than the second warp's extra instructions (sized by
    registers for sm_90a, not timed)."""
    wide = max(head_size, 128) // 128
    tile = max((128 if group <= 8 else 64) // wide, 16)
    if fmt is None:
        fmt = OscarFormat(head_size=head_size, block_size=128, sink=0, window=0)
    warps = LAUNCH["num_warps"]
    while live_registers(fmt, group, tile, warps) > LIVE_LIMIT and warps < 4:
        warps *= 2
    launch = {**LAUNCH, "num_warps": warps, "tile": tile, "bf16_rows": max(32 // wide, 16)}
    if fmt.k.int4 or fmt.v.int4:
        # left to itself, ptxas trims some plans with INT4 tiers to 168 registers
        # by spilling a few bytes; OSCAR INT2 keeps its own choice (168, no spill)
        launch["maxnreg"] = 255
    return launch


def _compiled(x: torch.Tensor) -> bool:
    """Inline PTX only where Triton compiles for a GPU (not in its interpreter)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def row_pieces(code_bytes: int, int4_bytes: int = 0) -> tuple:
    """A row's code bytes, rounded up to a multiple of 16, as power-of-two
    runs ``(first byte, bytes, planes, first plane)``, largest first; each
    run is one tile of codes and one tensor-core pass a plane. A run of INT4
    bytes only unpacks as two nibble planes, a run holding INT2 codes as four
    crumbs (:func:`_planes`): so the INT4 bytes' whole 16-byte runs (all of
    them where the row holds no INT2 code) come first, on their own (K 48x4
    + 80x2, 44 bytes: 16 in nibbles, then 32 in crumbs, the last 4 masked)."""
    total = -(-code_bytes // 16) * 16
    nibbles = total if int4_bytes >= code_bytes else int4_bytes // 16 * 16
    out, plane = [], 0
    for at, end, planes in ((0, nibbles, 2), (nibbles, total, 4)):
        while at < end:
            n = 1 << ((end - at).bit_length() - 1)
            out.append((at, n, planes, plane))
            at += n
            plane += planes
    return tuple(out)


@triton.jit
def softmax_step(s, m_i, l_i, KEYS: tl.constexpr):
    """Online-softmax update over one tile of base-2 scores ``s`` whose keys
    run along axis KEYS; returns (p, alpha, m, l). Queries with no live key
    so far stay at zero."""
    m_new = tl.maximum(m_i, tl.max(s, axis=KEYS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - tl.expand_dims(m_safe, KEYS))
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=KEYS)


@triton.jit
def _crumb(codes, J: tl.constexpr):
    """fp16 ``4**J * crumb_J * 2**-24`` of bits 2J, 2J+1 of each code byte:
    the bits kept where they are, read as a subnormal fp16 (one AND per
    element; exact, and the tensor cores take subnormal fp16). An INT2 code
    is one crumb; an INT4 nibble is two (``c0 + 4 c1``, ``16 (c2 + 4 c3)``).
    The powers of two are divided out of q (keys) or of the result (values),
    the ``2**-24`` out of the scores and the result."""
    return (codes & (3 << (2 * J))).to(tl.float16, bitcast=True)


@triton.jit
def _planes(codes, P: tl.constexpr, ASM: tl.constexpr):
    """The P planes of a tile of code bytes: four crumbs (bits 2j, 2j+1 of
    each byte, :func:`_crumb`), or for INT4 bytes two nibbles (bits 0-3 and
    4-7, read the same way: crumbs 0 + 1 and 2 + 3 of the byte at once).
    Compiled, without spreading bytes to 16-bit lanes: a word's bytes 0 and
    2 already sit in the low bits of its two lanes, and so do bytes 1 and 3
    of the word shifted by 8. So each plane's first register holds bytes (0,
    2), its second (1, 3): elements 1 and 2 of every four trade places,
    which the caller undoes on the other operand (:func:`_swap12`). One
    shift per word, one AND per two codes and plane."""
    if ASM:
        if P == 4:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 h; shr.b32 h, $8, 8; "
                "and.b32 $0, $8, 0x00030003; and.b32 $1, h, 0x00030003; "
                "and.b32 $2, $8, 0x000c000c; and.b32 $3, h, 0x000c000c; "
                "and.b32 $4, $8, 0x00300030; and.b32 $5, h, 0x00300030; "
                "and.b32 $6, $8, 0x00c000c0; and.b32 $7, h, 0x00c000c0; }",
                "=r,=r,=r,=r,=r,=r,=r,=r,r", [codes],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 h; shr.b32 h, $4, 8; "
                "and.b32 $0, $4, 0x000f000f; and.b32 $1, h, 0x000f000f; "
                "and.b32 $2, $4, 0x00f000f0; and.b32 $3, h, 0x00f000f0; }",
                "=r,=r,=r,=r,r", [codes], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        c = codes.to(tl.int16)
        if P == 4:
            out = (_crumb(c, 0), _crumb(c, 1), _crumb(c, 2), _crumb(c, 3))
        else:
            out = ((c & 0x0F).to(tl.float16, bitcast=True), (c & 0xF0).to(tl.float16, bitcast=True))
    return out


@triton.jit
def _swap12(x, ASM: tl.constexpr):
    """Index ``x`` with elements 1 and 2 of every four swapped where
    :func:`_crumbs` unpacks (they trade places there), else ``x``."""
    if ASM:
        return (x & ~3) | ((x & 1) << 1) | ((x >> 1) & 1)
    return x


@triton.jit
def _crumb_map(byte, J: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr):
    """For crumb J of code bytes ``byte``: (element of the row, its power of
    two to divide out, its tier, whether the byte holds codes). Bytes below
    W4/2 are INT4 (crumbs 0, 1: the low nibble's element; 2, 3: the high
    nibble's, a sixteenth; a nibble plane is crumb 0 or 2), then W2/4 INT2
    bytes (crumb j: one element)."""
    NB4: tl.constexpr = W4 // 2
    NB2: tl.constexpr = W2 // 4
    if W4 == 0:
        elem = byte + J * NB2
        div = tl.full(byte.shape, 4.0 ** J, tl.float32)
        tier = byte * 0
    else:
        is4 = byte < NB4
        b2 = tl.maximum(byte - NB4, 0)
        if J < 2:
            e4 = byte
            d4 = 1.0
        else:
            e4 = byte + NB4
            d4 = 16.0
        elem = tl.where(is4, e4, W4 + b2 + J * NB2)
        div = tl.where(is4, d4, 4.0 ** J)
        tier = tl.where(is4, 0, 1)
    return elem, div, tier, byte < NB4 + NB2


@triton.jit
def _interleave(x, y, NG: tl.constexpr):
    """``[R, GP]`` tensors of tiers 0 and 1 as one ``[R, NG GP]`` tensor,
    column ``h NG + g`` (tier g of query head h); just ``x`` for one tier."""
    if NG == 2:
        x = tl.reshape(tl.join(x, y), (x.shape[0], 2 * x.shape[1]))
    return x


@triton.jit
def _deinterleave(x, NG: tl.constexpr, GP: tl.constexpr):
    """Inverse of :func:`_interleave`: (tier 0, tier 1) ``[R, GP]``."""
    if NG == 2:
        a, b = tl.split(tl.reshape(x, (x.shape[0], GP, 2)))
    else:
        a = x
        b = x
    return a, b


@triton.jit
def _query_plane(q_base, qmask, q_scale, B0: tl.constexpr, N: tl.constexpr, J: tl.constexpr, W4: tl.constexpr,
                 W2: tl.constexpr, NG: tl.constexpr, ASM: tl.constexpr):
    """q operand ``[N, NG GP]`` fp16 of crumb J of key code bytes ``B0 ..
    B0 + N`` (in the order they unpack): each row q of its element over the
    crumb's power of two, in its tier's columns (zeros in the other's and in
    the rows past the codes)."""
    byte = B0 + _swap12(tl.arange(0, N), ASM)
    elem, div, tier, ok = _crumb_map(byte, J, W4, W2)
    q = tl.load(q_base[None, :] + elem[:, None], mask=qmask[None, :] & ok[:, None], other=0.0).to(tl.float32)
    q = (q * (q_scale / div)[:, None]).to(tl.float16)
    if NG == 2:
        q = _interleave(tl.where((tier == 0)[:, None], q, 0.0), tl.where((tier == 1)[:, None], q, 0.0), NG)
    return q


@triton.jit
def _tier_sums(q_base, qmask, q_scale, D: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr):
    """Sum of q (as the tensor cores see it: fp16) over each stored tier's
    elements, times 2^-24 like the key dots: (tier 0, tier 1) ``[GP]``."""
    e = tl.arange(0, D)
    q = (tl.load(q_base[None, :] + e[:, None], mask=qmask[None, :], other=0.0).to(tl.float32)
         * q_scale).to(tl.float16).to(tl.float32) * 5.9604644775390625e-08
    if W4 > 0:
        first = tl.sum(tl.where((e < W4)[:, None], q, 0.0), axis=0)
        second = tl.sum(tl.where(((e >= W4) & (e < W4 + W2))[:, None], q, 0.0), axis=0)
    else:
        first = tl.sum(tl.where((e < W2)[:, None], q, 0.0), axis=0)
        second = first
    return first, second


@triton.jit
def _f16_halves(w, ASM: tl.constexpr):
    """The fp16 (low, high) halves of int32 words, as fp32."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=f,=f,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pairs(cache_i32, at, r0, tk, NT: tl.constexpr, G: tl.constexpr, inside, PARTIAL: tl.constexpr,
           ASM: tl.constexpr):
    """fp32 (scale, min) of tier G of rows ``r0 + tk`` (one 32-bit load a
    pair); with PARTIAL, rows past the page read as zeros."""
    at = at + r0 * NT + G + tk * NT
    if PARTIAL:
        w = tl.load(at, mask=inside, other=0)
    else:
        w = tl.load(at)
    return _f16_halves(w, ASM)


@triton.jit
def _page_base(row, page, S: tl.constexpr, h, BLOCK_BYTES: tl.constexpr, STATE_BLOCKS: tl.constexpr):
    """Byte offset of one page's (block, KV head) region."""
    blk = tl.load(row + STATE_BLOCKS + page).to(tl.int64)
    return blk * S + h * BLOCK_BYTES


@triton.jit
def page_step(step, KB: tl.constexpr, STEP: tl.constexpr):
    """(page, first row in the page) of step ``step``: steps of STEP rows run
    page by page, a page's last one partial where STEP does not divide KB.
    Decode and extend both walk pages this way."""
    SUB: tl.constexpr = (KB + STEP - 1) // STEP  # steps per page
    return step // SUB, (step % SUB) * STEP


@triton.jit
def _step(step, m_i, l_i, mins_a, mins_b, vacc, qops, qs_a, qs_b, row, cache_u8, cache_i32, lo, hi, S: tl.constexpr, h,
          KP: tl.constexpr, VP: tl.constexpr, KC: tl.constexpr, VC: tl.constexpr, NK: tl.constexpr,
          NV: tl.constexpr, KB: tl.constexpr, BLOCK_BYTES: tl.constexpr, STATE_BLOCKS: tl.constexpr,
          GP: tl.constexpr, ASM: tl.constexpr, TILE: tl.constexpr, EDGE: tl.constexpr):
    """One TILE-token step of :func:`_split`: scores, the online-softmax update
    and the value products. Only an EDGE step (one reaching outside ``[lo,
    hi)``) masks its rows by position; the partial last step of a page (TILE
    not dividing KB) always masks its rows past the page."""
    PARTIAL: tl.constexpr = KB % TILE != 0
    t = tl.arange(0, TILE)
    tk = _swap12(t, ASM)  # key rows (and probabilities) in the values' token order
    page, r0 = page_step(step, KB, TILE)
    pbase = _page_base(row, page, S, h, BLOCK_BYTES, STATE_BLOCKS)
    r = r0 + tk  # key rows in the page
    inside = r < KB
    k_at = cache_i32 + (pbase + KB * (KC + VC)) // 4
    v_at = k_at + KB * NK
    ks_a, km_a = _pairs(cache_i32, k_at, r0, tk, NK, 0, inside, PARTIAL, ASM)
    vs_a, vm_a = _pairs(cache_i32, v_at, r0, tk, NV, 0, inside, PARTIAL, ASM)
    acc = tl.zeros([TILE, NK * GP], tl.float32)
    for i in tl.static_range(len(KP)):
        c = KP[i][0] + tl.arange(0, tl.constexpr(KP[i][1]))
        at = cache_u8 + pbase + r[:, None] * KC + c[None, :]  # token-major rows
        if PARTIAL or KP[i][0] + KP[i][1] > KC:
            codes = tl.load(at, mask=inside[:, None] & (c < KC)[None, :], other=0)
        else:
            codes = tl.load(at)
        planes = _planes(codes, KP[i][2], ASM)
        for j in tl.static_range(tl.constexpr(KP[i][2])):
            acc = tl.dot(planes[j], qops[KP[i][3] + j], acc)
    acc_a, acc_b = _deinterleave(acc, NK, GP)
    s = ks_a[:, None] * acc_a + km_a[:, None] * qs_a[None, :]
    if NK == 2:
        ks, km = _pairs(cache_i32, k_at, r0, tk, NK, 1, inside, PARTIAL, ASM)
        s += ks[:, None] * acc_b + km[:, None] * qs_b[None, :]
    if NV == 2:
        vs_b, vm_b = _pairs(cache_i32, v_at, r0, tk, NV, 1, inside, PARTIAL, ASM)
    else:
        vs_b = vs_a
        vm_b = vm_a
    if EDGE or PARTIAL:
        if EDGE:
            pos = page * KB + r
            ok = (pos >= lo) & (pos < hi)
            if PARTIAL:
                ok = ok & inside
        else:
            ok = inside
        s = tl.where(ok[:, None], s, float("-inf"))
        # rows past the range may hold stale bytes: keep them out of p * s
        vs_a = tl.where(ok, vs_a, 0.0)
        vm_a = tl.where(ok, vm_a, 0.0)
        vs_b = tl.where(ok, vs_b, 0.0)
        vm_b = tl.where(ok, vm_b, 0.0)
    # online softmax on 2^24 s (the scale enters the exp's argument, one FMA)
    m_new = tl.maximum(m_i, tl.max(s, axis=0) * 16777216.0)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * 16777216.0 - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    mins_a = mins_a * alpha + tl.sum(p * vm_a[:, None], axis=0)
    if NV == 2:
        mins_b = mins_b * alpha + tl.sum(p * vm_b[:, None], axis=0)
    pa = (p * vs_a[:, None]).to(tl.float16)
    if NV == 2:
        pv = _interleave(pa, (p * vs_b[:, None]).to(tl.float16), NV)
        alpha_v = _interleave(alpha[None, :], alpha[None, :], NV)
    else:
        pv = pa
        alpha_v = alpha[None, :]
    new = ()
    for i in tl.static_range(len(VP)):
        b = VP[i][0] + tl.arange(0, tl.constexpr(VP[i][1]))
        at = cache_u8 + pbase + KB * KC + b[:, None] * KB + r0 + t[None, :]  # byte-major rows
        if PARTIAL or VP[i][0] + VP[i][1] > VC:
            codes = tl.load(at, mask=(b < VC)[:, None] & (r0 + t < KB)[None, :], other=0)
        else:
            codes = tl.load(at)
        planes = _planes(codes, VP[i][2], ASM)
        for j in tl.static_range(tl.constexpr(VP[i][2])):
            new = new + (tl.dot(planes[j], pv, vacc[VP[i][3] + j] * alpha_v),)
    return m_new, l_i, mins_a, mins_b, new


@triton.jit
def _zeros(R: tl.constexpr, C: tl.constexpr):
    return tl.zeros([R, C], tl.float32)


@triton.jit
def _split(q_base, qmask, row, cache_u8, cache_i32, o_base, lse_ptr, L, split, S: tl.constexpr, h, kfill, vfill,
           q_scale, num_splits, KP: tl.constexpr, VP: tl.constexpr, K4: tl.constexpr, K2: tl.constexpr,
           V4: tl.constexpr, V2: tl.constexpr, D: tl.constexpr,
           KB: tl.constexpr, BLOCK_BYTES: tl.constexpr, SINK: tl.constexpr, WINDOW: tl.constexpr,
           STATE_BLOCKS: tl.constexpr, GP: tl.constexpr, ASM: tl.constexpr, NSTAGE: tl.constexpr,
           TILE: tl.constexpr):
    """One slice of whole pages of the quantized range ``[S0, L - W)``.

    A step is TILE tokens of one page; its codes and scales are contiguous.
    Where TILE does not divide the block (a hybrid model's blocks, sized by
    its state pages), a page's last step is partial: its rows past the page
    are masked, never read. Only the steps that reach outside the range (at
    most the first and the last of the slice) mask rows by position: the
    slice's inner steps run without (one FSEL a score and a scale fewer).
    Both products put the tokens on the tensor cores' M/K side and the few
    query heads of the KV head on N (padded to 8, not to 16 as a query-major
    product would be), one tier after the other in the columns (``h NG +
    g``): scores ``S^T = K Q^T [TILE, NG GP]`` and outputs ``O^T = V^T P^T``
    per crumb of each run of code bytes (:func:`row_pieces`). Crumb j of a
    byte enters as the subnormal fp16 ``4^j c_j 2^-24`` (:func:`_crumb`);
    with q divided by the crumb's power of two (:func:`_crumb_map`) and
    per-row, per-tier (s, m): ``q.k = sum over tiers of s 2^24 (q'.c') + m
    sum q``. Values: ``a += sum_t c' (p s)_t`` per crumb, the mins ``sum_t
    p_t m_t`` apart (one number per query head and tier), and ``o = a 2^24 /
    4^j + mins`` at the end (an INT4 nibble's two crumbs added). A K tier
    that is not stored adds one number per query head to every score (q
    times its calibrated mean): the slice's log-sum-exp takes it. A V tier
    that is not stored reads its calibrated mean.
    Where the codes unpack in registers (:func:`_crumbs`), elements 1 and 2
    of every four trade places: in the bytes of the keys (q is read the same
    way) and in the tokens of the values (the key rows, and so the
    probabilities, are read the same way).
    """
    KC: tl.constexpr = K4 // 2 + K2 // 4
    VC: tl.constexpr = V4 // 2 + V2 // 4
    NK: tl.constexpr = (K4 > 0) + (K2 > 0)
    NV: tl.constexpr = (V4 > 0) + (V2 > 0)
    K0: tl.constexpr = D - K4 - K2
    V0: tl.constexpr = D - V4 - V2
    SUB: tl.constexpr = (KB + TILE - 1) // TILE  # steps per page
    qops = ()
    for i in tl.static_range(len(KP)):
        for j in tl.static_range(tl.constexpr(KP[i][2])):
            qops = qops + (_query_plane(q_base, qmask, q_scale, KP[i][0], KP[i][1], j * (4 // KP[i][2]), K4, K2,
                                        NK, ASM),)
    qs_a, qs_b = _tier_sums(q_base, qmask, q_scale, D, K4, K2)

    lo = SINK
    hi = tl.maximum(L - WINDOW, SINK)
    first_page = lo // KB
    n_pages = tl.where(hi > lo, tl.cdiv(hi, KB) - first_page, 0)
    per = tl.cdiv(n_pages, num_splits)
    page_lo = first_page + split * per
    page_hi = tl.minimum(page_lo + per, first_page + n_pages)
    step_lo = page_lo * SUB
    # up to the step that holds row hi - 1: a long block (beside a draft
    # model's pages, 4096 tokens) would otherwise step through its empty tail
    step_hi = tl.maximum(tl.minimum(page_hi * SUB, (hi // KB) * SUB + tl.cdiv(hi % KB, TILE)), step_lo)
    # inner steps: all rows inside [lo, hi) (steps run in position order); a
    # page's partial last step ends at the page, so it is inner only if hi
    # lies past that page
    first_inner = (lo // KB) * SUB + tl.cdiv(lo % KB, TILE)
    last_inner = (hi // KB) * SUB + (hi % KB) // TILE
    inner_lo = tl.minimum(tl.maximum(first_inner, step_lo), step_hi)
    inner_hi = tl.minimum(tl.maximum(last_inner, inner_lo), step_hi)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    mins_a = tl.zeros([GP], tl.float32)
    mins_b = tl.zeros([GP], tl.float32)
    vacc = ()
    for i in tl.static_range(len(VP)):
        for j in tl.static_range(tl.constexpr(VP[i][2])):
            vacc = vacc + (_zeros(VP[i][1], NV * GP),)
    for step in tl.range(step_lo, inner_lo, num_stages=2):
        m_i, l_i, mins_a, mins_b, vacc = _step(
            step, m_i, l_i, mins_a, mins_b, vacc, qops, qs_a, qs_b, row, cache_u8, cache_i32, lo, hi, S, h,
            KP, VP, KC, VC, NK, NV, KB, BLOCK_BYTES, STATE_BLOCKS, GP, ASM, TILE, True)
    for step in tl.range(inner_lo, inner_hi, num_stages=NSTAGE):
        # a step's addresses come from the loop index alone, so Triton copies
        # the next step's codes and scales while this one is read, and reads
        # the block table further ahead (num_stages)
        m_i, l_i, mins_a, mins_b, vacc = _step(
            step, m_i, l_i, mins_a, mins_b, vacc, qops, qs_a, qs_b, row, cache_u8, cache_i32, lo, hi, S, h,
            KP, VP, KC, VC, NK, NV, KB, BLOCK_BYTES, STATE_BLOCKS, GP, ASM, TILE, False)
    for step in tl.range(inner_hi, step_hi, num_stages=2):
        m_i, l_i, mins_a, mins_b, vacc = _step(
            step, m_i, l_i, mins_a, mins_b, vacc, qops, qs_a, qs_b, row, cache_u8, cache_i32, lo, hi, S, h,
            KP, VP, KC, VC, NK, NV, KB, BLOCK_BYTES, STATE_BLOCKS, GP, ASM, TILE, True)

    live = l_i > 0
    inv = tl.where(live, 1.0 / l_i, 0.0)
    qm = qmask[None, :]
    for i in tl.static_range(len(VP)):
        byte = VP[i][0] + tl.arange(0, tl.constexpr(VP[i][1]))
        is4 = (byte < V4 // 2)[:, None]
        for j in tl.static_range(tl.constexpr(VP[i][2])):
            a = vacc[VP[i][3] + j]
            if V4 > 0 and VP[i][2] == 4 and j % 2 == 0:  # an INT4 nibble is this crumb and the next
                a = tl.where(is4, a + vacc[VP[i][3] + j + 1], a)
            a_a, a_b = _deinterleave(a, NV, GP)
            # plane j is crumb j, or of nibbles crumb 2j
            elem, div, tier, ok = _crumb_map(byte, j * (4 // VP[i][2]), V4, V2)
            if V4 > 0 and VP[i][2] == 4 and j % 2 == 1:
                ok = ok & (byte >= V4 // 2)
            if NV == 2:
                a = tl.where((tier == 0)[:, None], a_a, a_b)
                mins = tl.where((tier == 0)[:, None], mins_a[None, :], mins_b[None, :])
            else:
                a = a_a
                mins = mins_a[None, :]
            out = (a * (16777216.0 / div)[:, None] + mins) * inv[None, :]
            tl.store(o_base[None, :] + elem[:, None], out, mask=qm & ok[:, None])
    lse = m_i + tl.log2(l_i)
    if K0 > 0:
        # every score of this slice moves by q . (the 0-bit keys' mean)
        e0 = tl.arange(0, triton.next_power_of_2(K0))
        zk = e0 < K0
        qz = tl.load(q_base[None, :] + (D - K0 + e0)[:, None], mask=qm & zk[:, None], other=0.0).to(tl.float32)
        lse += tl.sum(qz * tl.load(kfill + h * K0 + e0, mask=zk, other=0.0)[:, None], axis=0) * q_scale
    if V0 > 0:
        e0 = tl.arange(0, triton.next_power_of_2(V0))
        zv = e0 < V0
        f = tl.load(vfill + h * V0 + e0, mask=zv, other=0.0)
        tl.store(o_base[None, :] + (D - V0 + e0)[:, None], tl.where(live[None, :], f[:, None], 0.0),
                 mask=qm & zv[:, None])
    tl.store(lse_ptr, tl.where(live, lse, float("-inf")), mask=qmask)


@triton.jit
def _bf16_rows(q_base, qmask, row, cache_bf16, o_base, lse_ptr, L, chunk, S: tl.constexpr, h, D: tl.constexpr,
               BLOCK_BYTES: tl.constexpr, SINK: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr,
               ROWS: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, q_scale):
    """BLOCK_N state slots (chunk ``chunk``) of the live BF16 sink/window rows."""
    d = tl.arange(0, D)
    q = (tl.load(q_base[:, None] + d[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
         * q_scale).to(tl.float16)
    slot = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    if RING == WINDOW:
        # ring slots fill in order, so the live slots are exactly 0 .. min(L, S0 + W)
        ok = slot < tl.minimum(L, SINK + WINDOW)
    else:
        # a slot past the sink holds the latest position up to L - 1 that maps
        # to it; live if that position is inside the window (the other k
        # slots hold older rows, or drafts a later step rejected)
        last = L - 1
        pos = last - ((tl.maximum(last - SINK, 0) % RING) - (slot - SINK) + RING) % RING
        ok = tl.where(slot < SINK, slot < L, (slot < SINK + RING) & (pos >= tl.maximum(L - WINDOW, SINK)))
    sblk = tl.load(row + slot // ROWS, mask=ok, other=0).to(tl.int64)
    sbase = sblk * (S // 2) + h * (BLOCK_BYTES // 2) + (slot % ROWS) * (2 * D)
    k = tl.load(cache_bf16 + sbase[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
    v = tl.load(cache_bf16 + sbase[:, None] + D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
    s = tl.dot(q, tl.trans(k))
    s = tl.where(ok[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_safe[:, None])
    l_i = tl.sum(p, axis=1)
    acc = tl.dot(p.to(tl.float16), v)
    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    tl.store(o_base[:, None] + d[None, :], acc * inv[:, None], mask=qmask[:, None])
    tl.store(lse_ptr, tl.where(l_i > 0, m + tl.log2(l_i), float("-inf")), mask=qmask)


@triton.jit
def _decode_kernel(q_ptr, stride_qb, stride_qh, bt_ptr, bt_stride, seq_ptr,
                   cache_u8, cache_i32, cache_bf16, kfill, vfill, o_ptr, lse_ptr, q_scale, num_splits,
                   S: tl.constexpr, HQ: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                   KP: tl.constexpr, VP: tl.constexpr, K4: tl.constexpr, K2: tl.constexpr,
                   V4: tl.constexpr, V2: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                   SINK: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr, STATE_BLOCKS: tl.constexpr,
                   ROWS: tl.constexpr, NUM_BF16: tl.constexpr,
                   BLOCK_N: tl.constexpr, ASM: tl.constexpr, NSTAGE: tl.constexpr,
                   TILE: tl.constexpr, Q: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    gi = tl.arange(0, GP)
    qmask = gi < GROUP
    hq = h * GROUP + gi
    q_base = q_ptr + b.to(tl.int64) * stride_qb + hq * stride_qh
    if Q == 1:
        row = bt_ptr + b.to(tl.int64) * bt_stride
        L = tl.load(seq_ptr + b)
    else:  # query row b: request b // Q, its (b % Q)-th of the last Q positions
        req = b // Q
        row = bt_ptr + req.to(tl.int64) * bt_stride
        L = tl.maximum(tl.load(seq_ptr + req) - (Q - 1 - b % Q), 0)
    part = (b * HQ + hq).to(tl.int64) * (num_splits + NUM_BF16) + split
    o_base = o_ptr + part * D
    if split < num_splits:
        _split(q_base, qmask, row, cache_u8, cache_i32, o_base, lse_ptr + part, L, split, S, h, kfill, vfill,
               q_scale, num_splits, KP, VP, K4, K2, V4, V2, D, KB, BLOCK_BYTES, SINK, WINDOW,
               STATE_BLOCKS, GP, ASM, NSTAGE, TILE)
    else:
        _bf16_rows(q_base, qmask, row, cache_bf16, o_base, lse_ptr + part, L, split - num_splits, S, h, D,
                   BLOCK_BYTES, SINK, WINDOW, RING, ROWS, GP, BLOCK_N, q_scale)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, parts, HQ: tl.constexpr,
                  D: tl.constexpr, CHUNK: tl.constexpr):
    """Combine the partial outputs of one (request, query head) by their LSE,
    CHUNK parts at a time (hundreds of parts would not fit in registers)."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    first = (b * HQ + hq).to(tl.int64) * parts
    top = tl.full([CHUNK], float("-inf"), tl.float32)
    for c in range(0, parts, CHUNK):
        j = c + tl.arange(0, CHUNK)
        top = tl.maximum(top, tl.load(lse_ptr + first + j, mask=j < parts, other=float("-inf")))
    top = tl.max(top, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    total = tl.zeros([CHUNK], tl.float32)
    for c in range(0, parts, CHUNK):
        j = c + tl.arange(0, CHUNK)
        w = tl.exp2(tl.load(lse_ptr + first + j, mask=j < parts, other=float("-inf")) - top)
        o = tl.load(o_ptr + (first + j)[:, None] * D + d[None, :], mask=(j < parts)[:, None], other=0.0)
        acc += tl.sum(o * w[:, None], axis=0)
        total += w
    denom = tl.sum(total, axis=0)
    out = acc / tl.where(denom > 0, denom, 1.0)  # no key at all (a padding row of length 0): zeros
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def num_splits(batch: int, kv_heads: int, max_context: int, sm_count: int, block_size: int = 128) -> int:
    """Quantized-range splits per (request, KV head): at most 32 programs per
    SM (an SM holds 11 one-warp programs at the default launch: 168 registers
    a thread, 19 KB of shared memory a program), each slice at least four
    pages long (the prologue and the merge stay small against the pages
    read). On the H200, batch 32 at 100K tokens took 0.59-0.62 ms at every
    count from 8 to 64 (benchmarks/oscar_kernels.py, its split sweep): the
    count matters little once the SMs are full."""
    want = 32 * sm_count // max(batch * kv_heads, 1)
    longest = max(1, max_context // (4 * block_size))
    return max(1, min(want, longest, 256))


def fill_tensor(fill: torch.Tensor | None, width: int, device) -> torch.Tensor:
    """The ``[H, width]`` fp32 means of a 0-bit tier (a dummy when there is none)."""
    if not width:
        return torch.zeros(1, dtype=torch.float32, device=device)
    if fill is None or fill.shape[-1] != width:
        raise ValueError(f"a 0-bit tier of {width} directions needs its calibrated mean [H, {width}]")
    return fill.to(device=device, dtype=torch.float32).contiguous()


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    fmt: OscarFormat,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int,
    out: torch.Tensor,
    launch: dict | None = None,
    fills=(None, None),
    query_len: int = 1,
) -> torch.Tensor:
    """Attention of ``q [B * query_len, Hq, D]`` (rotated; the last
    ``query_len`` positions of each request, ending at ``seq_lens - 1``, their
    own K/V already stored) over each request's cache, causal, into ``out``
    (the shape of ``q``). ``launch``: Triton launch options over
    :func:`default_launch` (num_warps, num_stages, tile, bf16_rows);
    ``fills``: the K and V 0-bit tiers' means ``[H, width]`` (this rank's KV
    heads)."""
    b, hq, d = q.shape
    h = kv_cache.shape[1]
    group = hq // h
    if fmt.block_size < 16:
        raise ValueError(f"OSCAR Triton decode needs block_size >= 16, got {fmt.block_size}")
    fmt.check_query_len(query_len)
    if b == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    lc = {**default_launch(group, d, fmt), **(launch or {})}
    # a block shorter than the step takes one step a page, masked past its end
    tile = min(lc["tile"], triton.next_power_of_2(fmt.block_size))
    n_bf16 = triton.cdiv(max(fmt.sink + fmt.ring, 1), lc["bf16_rows"])
    parts = splits + n_bf16
    o_part = torch.empty(b, hq, parts, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b, hq, parts, dtype=torch.float32, device=q.device)
    _decode_kernel[(b, h, parts)](
        q, q.stride(0), q.stride(1), block_table, block_table.stride(0), seq_lens,
        kv_cache, kv_cache.view(torch.int32), kv_cache.view(torch.bfloat16),
        fill_tensor(fills[0], fmt.k.zero, q.device), fill_tensor(fills[1], fmt.v.zero, q.device), o_part, lse_part,
        scale * LOG2E, splits, S=fmt.block_stride(kv_cache), HQ=hq, GROUP=group, GP=triton.next_power_of_2(group),
        KP=row_pieces(fmt.k.code_bytes, fmt.k.int4 // 2), VP=row_pieces(fmt.v.code_bytes, fmt.v.int4 // 2), K4=fmt.k.int4, K2=fmt.k.int2,
        V4=fmt.v.int4, V2=fmt.v.int2, D=d, KB=fmt.block_size, BLOCK_BYTES=fmt.block_bytes,
        SINK=fmt.sink, WINDOW=fmt.window, RING=max(fmt.ring, 1), STATE_BLOCKS=fmt.state_blocks,
        ROWS=fmt.state_rows_per_block, NUM_BF16=n_bf16, BLOCK_N=lc["bf16_rows"], ASM=_compiled(q),
        NSTAGE=lc["num_stages"], TILE=tile, Q=query_len, num_warps=lc["num_warps"], num_stages=lc["num_stages"],
        **({"maxnreg": lc["maxnreg"]} if lc.get("maxnreg") else {}),
    )
    _merge_kernel[(b, hq)](o_part, lse_part, out, out.stride(0), out.stride(1), parts, HQ=hq, D=d, CHUNK=16)
    return out
