"""Split-KV OSCAR decode: one query token per request over INT2 pages plus the
BF16 sink and window, merged by log-sum-exp.

Twin of :func:`reference.mixed_attention` for a single query at position
``L - 1`` of a request of length ``L``: keys ``[S0, L - W)`` are read INT2,
the sink ``[0, S0)`` and the window ``[L - W, L)`` BF16 from the state blocks.

Grid ``(B, H, splits + bf16 programs)``: programs ``0 .. splits-1`` of a
(request, KV head) stream equal slices of its INT2 range; the others each
read ``bf16_rows`` of its ``min(L, S0 + W)`` BF16 state rows. Every program
serves all query heads of its KV head (GQA: each page byte is read once).
INT2 codes are never expanded to values in memory: with ``k = code * s + m``
per row and group, ``q.k = s (q.code) + m sum(q)``, so the dot products run on
the raw codes and the per-token scale and min are applied to the scores (and,
for values, to the probabilities). No host sync, and the split count depends only on the
batch size and static config: safe to capture in a CUDA graph. A request of
length 0 (vLLM's padding of a replayed batch) reads no page and gets zeros.
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


def default_launch(group: int, head_size: int) -> dict:
    """The launch for ``group`` query heads per KV head of ``head_size``.

    Registers grow with the step's tokens x head size: wider groups halve the
    step, and so does each doubling of the head size past 128, as do the
    BF16 programs' rows (head size 256 then compiles without spills for sm_90a;
    sized by registers, not timed)."""
    wide = max(head_size, 128) // 128
    return {**LAUNCH, "tile": max((128 if group <= 8 else 64) // wide, 16), "bf16_rows": max(32 // wide, 16)}


def _compiled(x: torch.Tensor) -> bool:
    """Inline PTX only where Triton compiles for a GPU (not in its interpreter)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


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
def _quarter(codes, J: tl.constexpr):
    """fp16 ``4**J * code_J * 2**-24`` of quarter J: the code's two bits, kept
    where they are, read as a subnormal fp16 (one AND per element; exact, and
    the tensor cores take subnormal fp16). The ``4**J`` is divided out of q
    (keys) or of the result (values), the ``2**-24`` out of the scores and the
    result."""
    return (codes & (3 << (2 * J))).to(tl.float16, bitcast=True)


@triton.jit
def _quarters_asm(codes):
    """:func:`_quarter` of all four quarters from packed registers (compiled
    path only), without spreading bytes to 16-bit lanes: a word's bytes 0 and 2
    already sit in the low bits of its two lanes, and so do bytes 1 and 3 of the
    word shifted by 8. So each quarter's first register holds bytes (0, 2), its
    second (1, 3): elements 1 and 2 of every four trade places, which the caller
    undoes on the other operand (:func:`_swap12`). One shift per word, one AND
    per two codes."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 h; shr.b32 h, $8, 8; "
        "and.b32 $0, $8, 0x00030003; and.b32 $1, h, 0x00030003; "
        "and.b32 $2, $8, 0x000c000c; and.b32 $3, h, 0x000c000c; "
        "and.b32 $4, $8, 0x00300030; and.b32 $5, h, 0x00300030; "
        "and.b32 $6, $8, 0x00c000c0; and.b32 $7, h, 0x00c000c0; }",
        "=r,=r,=r,=r,=r,=r,=r,=r,r", [codes],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _swap12(x, ASM: tl.constexpr):
    """Index ``x`` with elements 1 and 2 of every four swapped where
    :func:`_quarters_asm` unpacks (they trade places there), else ``x``."""
    if ASM:
        return (x & ~3) | ((x & 1) << 1) | ((x >> 1) & 1)
    return x


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
def _page_base(row, page, H, h, D: tl.constexpr, NG: tl.constexpr, KB: tl.constexpr,
               STATE_BLOCKS: tl.constexpr):
    """Byte offset of one page's (block, KV head) region."""
    BLOCK_BYTES: tl.constexpr = KB * (D // 2 + 8 * NG)
    blk = tl.load(row + STATE_BLOCKS + page).to(tl.int64)
    return (blk * H + h) * BLOCK_BYTES


@triton.jit
def page_step(step, KB: tl.constexpr, STEP: tl.constexpr):
    """(page, first row in the page) of INT2 step ``step``: steps of STEP
    rows run page by page, a page's last one partial where STEP does not
    divide KB. Decode and extend both walk pages this way."""
    SUB: tl.constexpr = (KB + STEP - 1) // STEP  # steps per page
    return step // SUB, (step % SUB) * STEP


@triton.jit
def _load_pairs(cache_i32, base, t, g: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, KB: tl.constexpr,
                PARTIAL: tl.constexpr, ASM: tl.constexpr):
    """fp32 (scale, min) of group ``g`` of rows ``t`` of a page, K then V, one
    32-bit load per pair; with PARTIAL, rows past the page read as zeros."""
    at = cache_i32 + base // 4 + KB * (D // 8) + t * NG + g
    if PARTIAL:
        inside = t < KB
        kw = tl.load(at, mask=inside, other=0)
        vw = tl.load(at + KB * NG, mask=inside, other=0)
    else:
        kw = tl.load(at)
        vw = tl.load(at + KB * NG)
    ks, km = _f16_halves(kw, ASM)
    vs, vm = _f16_halves(vw, ASM)
    return ks, km, vs, vm


@triton.jit
def _int2_step(step, m_i, l_i, mins_a, mins_b, a0, a1, a2, a3, q0, q1, q2, q3, qs_a, qs_b,
               row, cache_u8, cache_i32, lo, hi, H, h, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr,
               STATE_BLOCKS: tl.constexpr, ASM: tl.constexpr, TILE: tl.constexpr, EDGE: tl.constexpr):
    """One TILE-token step of :func:`_int2_split`: scores, the online-softmax
    update and the value products. Only an EDGE step (one reaching outside
    ``[lo, hi)``) masks its rows by position; the partial last step of a page
    (TILE not dividing KB) always masks its rows past the page."""
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    PARTIAL: tl.constexpr = KB % TILE != 0
    d4 = tl.arange(0, D4)
    t = tl.arange(0, TILE)
    tk = _swap12(t, ASM)                              # key rows (and probabilities) in the values' token order
    page, r0 = page_step(step, KB, TILE)
    pbase = _page_base(row, page, H, h, D, NG, KB, STATE_BLOCKS)
    r = r0 + tk  # key rows in the page
    ks_a, km_a, vs_a, vm_a = _load_pairs(cache_i32, pbase, r, 0, D, NG, KB, PARTIAL, ASM)
    k_at = cache_u8 + pbase + r0 * D4 + tk[:, None] * D4 + d4[None, :]      # K: [TILE, D4], token-major
    v_at = cache_u8 + pbase + KB * D4 + r0 + d4[:, None] * KB + t[None, :]  # V: [D4, TILE], byte-major
    if PARTIAL:
        kc = tl.load(k_at, mask=(r < KB)[:, None], other=0)
        vc = tl.load(v_at, mask=(r0 + t < KB)[None, :], other=0)
    else:
        kc = tl.load(k_at)
        vc = tl.load(v_at)
    if ASM:
        k0, k1, k2, k3 = _quarters_asm(kc)
    else:
        kq = kc.to(tl.int16)
        k0 = _quarter(kq, 0)
        k1 = _quarter(kq, 1)
        k2 = _quarter(kq, 2)
        k3 = _quarter(kq, 3)
    if NG == 1:
        acc = tl.dot(k0, q0)
        acc = tl.dot(k1, q1, acc)
        acc = tl.dot(k2, q2, acc)
        acc = tl.dot(k3, q3, acc)
        s = ks_a[:, None] * acc + km_a[:, None] * qs_a[None, :]
    else:
        ks_b, km_b, vs_b, vm_b = _load_pairs(cache_i32, pbase, r, 1, D, NG, KB, PARTIAL, ASM)
        acc_a = tl.dot(k0, q0)
        acc_a = tl.dot(k1, q1, acc_a)
        acc_b = tl.dot(k2, q2)
        acc_b = tl.dot(k3, q3, acc_b)
        s = (ks_a[:, None] * acc_a + km_a[:, None] * qs_a[None, :]
             + ks_b[:, None] * acc_b + km_b[:, None] * qs_b[None, :])
    if EDGE or PARTIAL:
        if EDGE:
            pos = page * KB + r
            ok = (pos >= lo) & (pos < hi)
            if PARTIAL:
                ok = ok & (r < KB)
        else:
            ok = r < KB
        s = tl.where(ok[:, None], s, float("-inf"))
        # rows past the range may hold stale bytes: keep them out of p * s
        vs_a = tl.where(ok, vs_a, 0.0)
        vm_a = tl.where(ok, vm_a, 0.0)
        if NG == 2:
            vs_b = tl.where(ok, vs_b, 0.0)
            vm_b = tl.where(ok, vm_b, 0.0)
    # online softmax on 2^24 s (the scale enters the exp's argument, one FMA)
    m_new = tl.maximum(m_i, tl.max(s, axis=0) * 16777216.0)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * 16777216.0 - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)

    pa = (p * vs_a[:, None]).to(tl.float16)
    mins_a = mins_a * alpha + tl.sum(p * vm_a[:, None], axis=0)
    if NG == 1:
        pb = pa
    else:
        pb = (p * vs_b[:, None]).to(tl.float16)
        mins_b = mins_b * alpha + tl.sum(p * vm_b[:, None], axis=0)
    if ASM:
        v0, v1, v2, v3 = _quarters_asm(vc)
    else:
        vq = vc.to(tl.int16)
        v0 = _quarter(vq, 0)
        v1 = _quarter(vq, 1)
        v2 = _quarter(vq, 2)
        v3 = _quarter(vq, 3)
    a0 = tl.dot(v0, pa, a0 * alpha[None, :])
    a1 = tl.dot(v1, pa, a1 * alpha[None, :])
    a2 = tl.dot(v2, pb, a2 * alpha[None, :])
    a3 = tl.dot(v3, pb, a3 * alpha[None, :])
    return m_new, l_i, mins_a, mins_b, a0, a1, a2, a3


@triton.jit
def _int2_split(q_base, qmask, row, cache_u8, cache_i32, o_base, lse_ptr, L, split,
                H, h, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, SINK: tl.constexpr,
                WINDOW: tl.constexpr, STATE_BLOCKS: tl.constexpr, num_splits,
                GP: tl.constexpr, q_scale, ASM: tl.constexpr, NSTAGE: tl.constexpr,
                TILE: tl.constexpr):
    """One slice of whole pages of the INT2 range ``[S0, L - W)``.

    A step is TILE tokens of one page; its codes and scales are contiguous.
    Where TILE does not divide the block (a hybrid model's blocks, sized by
    its state pages), a page's last step is partial: its rows past the page
    are masked, never read. Only the steps that reach outside the range (at
    most the first and the last of the slice) mask rows by position: the
    slice's inner steps run without (one FSEL a score and a scale fewer).
    Both products put the tokens on the tensor cores' M/K side and the few
    query heads of the KV head on N (padded to 8, not to 16 as a query-major
    product would be): scores ``S^T = K Q^T [TILE, GP]`` and outputs ``O^T =
    V^T P^T [D/4, GP]`` per quarter. Quarter j of the head dim enters as the
    subnormal fp16 ``c'_j = 4^j code 2^-24`` (:func:`_quarter`); with ``q'_j =
    q_j / 4^j`` and per-row (s, m): ``q.k = s 2^24 (sum_j q'_j.c'_j) + m sum q``.
    Values: ``a_j += sum_t c'_j (p s)_t``, the mins ``sum_t p_t m_t`` apart (one
    number per query head), and ``o_j = a_j 2^24 / 4^j + mins`` at the end.
    Where the codes unpack in registers (:func:`_quarters_asm`), elements 1
    and 2 of every four trade places: in the head dim of the keys (q is read
    the same way) and in the tokens of the values (the key rows, and so the
    probabilities, are read the same way).
    """
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    TINY: tl.constexpr = 5.9604644775390625e-08  # 2^-24
    d4 = tl.arange(0, D4)
    SUB: tl.constexpr = (KB + TILE - 1) // TILE  # steps per page
    qp = q_base[None, :] + _swap12(d4, ASM)[:, None]  # [D4, GP], in the keys' element order
    qm = qmask[None, :]
    q0 = (tl.load(qp, mask=qm, other=0.0).to(tl.float32) * q_scale).to(tl.float16)
    q1 = (tl.load(qp + D4, mask=qm, other=0.0).to(tl.float32) * (q_scale * 0.25)).to(tl.float16)
    q2 = (tl.load(qp + 2 * D4, mask=qm, other=0.0).to(tl.float32) * (q_scale * 0.0625)).to(tl.float16)
    q3 = (tl.load(qp + 3 * D4, mask=qm, other=0.0).to(tl.float32) * (q_scale * 0.015625)).to(tl.float16)
    # sum q per group, times 2^-24 like the key dots (the scores stay 2^-24 small until the exp)
    qs_a = (tl.sum(q0.to(tl.float32), axis=0) + 4.0 * tl.sum(q1.to(tl.float32), axis=0)) * TINY
    qs_b = (16.0 * tl.sum(q2.to(tl.float32), axis=0) + 64.0 * tl.sum(q3.to(tl.float32), axis=0)) * TINY
    if NG == 1:
        qs_a = qs_a + qs_b

    lo = SINK
    hi = tl.maximum(L - WINDOW, SINK)
    first_page = lo // KB
    n_pages = tl.where(hi > lo, tl.cdiv(hi, KB) - first_page, 0)
    per = tl.cdiv(n_pages, num_splits)
    page_lo = first_page + split * per
    page_hi = tl.minimum(page_lo + per, first_page + n_pages)
    step_lo = page_lo * SUB
    step_hi = tl.maximum(page_hi * SUB, step_lo)
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
    a0 = tl.zeros([D4, GP], tl.float32)
    a1 = tl.zeros([D4, GP], tl.float32)
    a2 = tl.zeros([D4, GP], tl.float32)
    a3 = tl.zeros([D4, GP], tl.float32)
    for step in tl.range(step_lo, inner_lo, num_stages=2):
        m_i, l_i, mins_a, mins_b, a0, a1, a2, a3 = _int2_step(
            step, m_i, l_i, mins_a, mins_b, a0, a1, a2, a3, q0, q1, q2, q3, qs_a, qs_b,
            row, cache_u8, cache_i32, lo, hi, H, h, D, G, KB, STATE_BLOCKS, ASM, TILE, True)
    for step in tl.range(inner_lo, inner_hi, num_stages=NSTAGE):
        # a step's addresses come from the loop index alone, so Triton copies
        # the next step's codes and scales while this one is read, and reads
        # the block table further ahead (num_stages)
        m_i, l_i, mins_a, mins_b, a0, a1, a2, a3 = _int2_step(
            step, m_i, l_i, mins_a, mins_b, a0, a1, a2, a3, q0, q1, q2, q3, qs_a, qs_b,
            row, cache_u8, cache_i32, lo, hi, H, h, D, G, KB, STATE_BLOCKS, ASM, TILE, False)
    for step in tl.range(inner_hi, step_hi, num_stages=2):
        m_i, l_i, mins_a, mins_b, a0, a1, a2, a3 = _int2_step(
            step, m_i, l_i, mins_a, mins_b, a0, a1, a2, a3, q0, q1, q2, q3, qs_a, qs_b,
            row, cache_u8, cache_i32, lo, hi, H, h, D, G, KB, STATE_BLOCKS, ASM, TILE, True)

    if NG == 1:
        mins_b = mins_a
    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    op = o_base[None, :] + d4[:, None]
    tl.store(op, (a0 * 16777216.0 + mins_a[None, :]) * inv[None, :], mask=qm)
    tl.store(op + D4, (a1 * 4194304.0 + mins_a[None, :]) * inv[None, :], mask=qm)
    tl.store(op + 2 * D4, (a2 * 1048576.0 + mins_b[None, :]) * inv[None, :], mask=qm)
    tl.store(op + 3 * D4, (a3 * 262144.0 + mins_b[None, :]) * inv[None, :], mask=qm)
    tl.store(lse_ptr, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")), mask=qmask)


@triton.jit
def _bf16_rows(q_base, qmask, row, cache_bf16, o_base, lse_ptr, L, chunk,
               H, h, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, SINK: tl.constexpr,
               WINDOW: tl.constexpr, ROWS: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, q_scale):
    """BLOCK_N state slots (chunk ``chunk``) of the live BF16 sink/window rows."""
    NG: tl.constexpr = D // G
    HALF_BLOCK: tl.constexpr = KB * (D // 2 + 8 * NG) // 2
    d = tl.arange(0, D)
    q = (tl.load(q_base[:, None] + d[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
         * q_scale).to(tl.float16)
    # ring slots fill in order, so the live slots are exactly 0 .. min(L, S0 + W)
    n_rows = tl.minimum(L, SINK + WINDOW)
    slot = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = slot < n_rows
    sblk = tl.load(row + slot // ROWS, mask=ok, other=0).to(tl.int64)
    sbase = (sblk * H + h) * HALF_BLOCK + (slot % ROWS) * (2 * D)
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
                   cache_u8, cache_i32, cache_bf16, o_ptr, lse_ptr, q_scale, num_splits,
                   H, HQ: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                   D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr,
                   SINK: tl.constexpr, WINDOW: tl.constexpr, STATE_BLOCKS: tl.constexpr,
                   ROWS: tl.constexpr, NUM_BF16: tl.constexpr,
                   BLOCK_N: tl.constexpr, ASM: tl.constexpr, NSTAGE: tl.constexpr,
                   TILE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    gi = tl.arange(0, GP)
    qmask = gi < GROUP
    hq = h * GROUP + gi
    q_base = q_ptr + b.to(tl.int64) * stride_qb + hq * stride_qh
    row = bt_ptr + b.to(tl.int64) * bt_stride
    L = tl.load(seq_ptr + b)
    part = (b * HQ + hq).to(tl.int64) * (num_splits + NUM_BF16) + split
    o_base = o_ptr + part * D
    if split < num_splits:
        _int2_split(q_base, qmask, row, cache_u8, cache_i32, o_base, lse_ptr + part, L, split,
                    H, h, D, G, KB, SINK, WINDOW, STATE_BLOCKS, num_splits, GP, q_scale, ASM, NSTAGE, TILE)
    else:
        _bf16_rows(q_base, qmask, row, cache_bf16, o_base, lse_ptr + part, L, split - num_splits,
                   H, h, D, G, KB, SINK, WINDOW, ROWS, GP, BLOCK_N, q_scale)


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
    """INT2 splits per (request, KV head): at most 32 programs per SM (an SM
    holds 11 one-warp programs at the default launch: 168 registers a thread,
    19 KB of shared memory a program),
    each slice at least four pages long (the prologue and the merge stay small
    against the pages read). On the H200, batch 32 at 100K tokens took
    0.59-0.62 ms at every count from 8 to 64 (benchmarks/oscar_kernels.py, its
    split sweep): the count matters little once the SMs are full."""
    want = 32 * sm_count // max(batch * kv_heads, 1)
    longest = max(1, max_context // (4 * block_size))
    return max(1, min(want, longest, 256))


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
) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` (rotated; position ``seq_lens - 1``, its
    own K/V already stored) over each request's cache, into ``out [B, Hq, D]``.
    ``launch``: Triton launch options over :func:`default_launch` (num_warps,
    num_stages, tile, bf16_rows)."""
    b, hq, d = q.shape
    h = kv_cache.shape[1]
    group = hq // h
    if fmt.groups not in (1, 2) or fmt.block_size < 16:
        raise ValueError(
            f"OSCAR Triton decode needs group_size head_size or head_size/2 and block_size >= 16, "
            f"got {fmt.group_size} and {fmt.block_size}")
    if b == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    lc = {**default_launch(group, d), **(launch or {})}
    # a block shorter than the step takes one step a page, masked past its end
    tile = min(lc["tile"], triton.next_power_of_2(fmt.block_size))
    n_bf16 = triton.cdiv(max(fmt.sink + fmt.window, 1), lc["bf16_rows"])
    parts = splits + n_bf16
    o_part = torch.empty(b, hq, parts, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b, hq, parts, dtype=torch.float32, device=q.device)
    _decode_kernel[(b, h, parts)](
        q, q.stride(0), q.stride(1), block_table, block_table.stride(0), seq_lens,
        kv_cache, kv_cache.view(torch.int32), kv_cache.view(torch.bfloat16), o_part, lse_part,
        scale * LOG2E, splits, h, HQ=hq, GROUP=group, GP=triton.next_power_of_2(group),
        D=d, G=fmt.group_size, KB=fmt.block_size, SINK=fmt.sink, WINDOW=fmt.window,
        STATE_BLOCKS=fmt.state_blocks, ROWS=fmt.state_rows_per_block,
        NUM_BF16=n_bf16, BLOCK_N=lc["bf16_rows"], ASM=_compiled(q), NSTAGE=lc["num_stages"],
        TILE=tile, num_warps=lc["num_warps"], num_stages=lc["num_stages"],
    )
    _merge_kernel[(b, hq)](o_part, lse_part, out, out.stride(0), out.stride(1), parts, HQ=hq, D=d, CHUNK=16)
    return out
