"""Split-KV OSCAR decode: one query token per request over INT2 pages plus the
BF16 sink and window, merged by log-sum-exp.

Twin of :func:`reference.mixed_attention` for a single query at position
``L - 1`` of a request of length ``L``: keys ``[S0, L - W)`` are read INT2,
the sink ``[0, S0)`` and the window ``[L - W, L)`` BF16 from the state blocks.

Grid ``(B, H, NUM_SPLITS + 1)``: programs ``0 .. NUM_SPLITS-1`` of a
(request, KV head) stream equal slices of its INT2 range; the last one reads
its ``min(L, S0 + W)`` BF16 state rows. Every program serves all query heads
of its KV head (GQA: each page byte is read once). INT2 codes are never
expanded to values in memory: with ``k = code * s + m`` per row and group,
``q.k = s (q.code) + m sum(q)``, so the dot products run on the raw codes and
the per-token scale and min are applied to the scores (and, for values, to
the probabilities). No host sync, fixed split count: safe to capture in a
CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.oscar.format import OscarFormat

LOG2E = 1.4426950408889634
LAUNCH = {"num_warps": 4, "num_stages": 2}


@triton.jit
def softmax_step(s, m_i, l_i):
    """Online-softmax update over one tile of base-2 scores ``s``; returns
    (p, alpha, m, l). Rows with no live key so far stay at zero."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _codes_plus_1024(codes, SHIFT: tl.constexpr):
    """fp16 ``1024 + code`` for one quarter, built from bits (``0x6400 | code``):
    no int-to-float conversion, which would cost more than the memory read."""
    return (((codes >> SHIFT) & 3) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _int2_split(q_base, qmask, row, cache_u8, cache_f16, o_base, lse_ptr, L, split,
                H, h, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, SINK: tl.constexpr,
                WINDOW: tl.constexpr, STATE_BLOCKS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                GP: tl.constexpr):
    """One slice of whole pages of the INT2 range ``[S0, L - W)``.

    A tile is one page (KB tokens): its codes and scales are contiguous. Per
    quarter j of the head dim, with c' = 1024 + code in fp16 and per-row (s, m):
    ``q.k = s (q.c' - 1024 sum q) + m sum q``; the value side is the same with
    ``p * s`` in place of q.
    """
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    BLOCK_BYTES: tl.constexpr = KB * (D // 2 + 8 * NG)
    # quarters 0, 1 use group GA, quarters 2, 3 group GB (NG is 1 or 2)
    GA: tl.constexpr = 0
    GB: tl.constexpr = NG - 1
    d4 = tl.arange(0, D4)
    t = tl.arange(0, KB)
    q0 = tl.load(q_base[:, None] + d4[None, :], mask=qmask[:, None], other=0.0).to(tl.float16)
    q1 = tl.load(q_base[:, None] + D4 + d4[None, :], mask=qmask[:, None], other=0.0).to(tl.float16)
    q2 = tl.load(q_base[:, None] + 2 * D4 + d4[None, :], mask=qmask[:, None], other=0.0).to(tl.float16)
    q3 = tl.load(q_base[:, None] + 3 * D4 + d4[None, :], mask=qmask[:, None], other=0.0).to(tl.float16)
    qsa = tl.sum(q0.to(tl.float32), axis=1) + tl.sum(q1.to(tl.float32), axis=1)
    qsb = tl.sum(q2.to(tl.float32), axis=1) + tl.sum(q3.to(tl.float32), axis=1)

    lo = SINK
    hi = tl.maximum(L - WINDOW, SINK)
    first_page = lo // KB
    n_pages = tl.where(hi > lo, tl.cdiv(hi, KB) - first_page, 0)
    per = tl.cdiv(n_pages, NUM_SPLITS)
    page_lo = first_page + split * per
    page_hi = tl.minimum(page_lo + per, first_page + n_pages)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([GP, D4], tl.float32)
    a1 = tl.zeros([GP, D4], tl.float32)
    a2 = tl.zeros([GP, D4], tl.float32)
    a3 = tl.zeros([GP, D4], tl.float32)
    for page in range(page_lo, page_hi):
        pos = page * KB + t
        ok = (pos >= lo) & (pos < hi)
        blk = tl.load(row + STATE_BLOCKS + page).to(tl.int64)
        base = (blk * H + h) * BLOCK_BYTES
        codes = base + t[:, None] * D4 + d4[None, :]
        kc = tl.load(cache_u8 + codes).to(tl.int16)
        vc = tl.load(cache_u8 + KB * D4 + codes).to(tl.int16)
        ksm = (base + KB * (D // 2)) // 2 + t * (2 * NG)
        vsm = ksm + KB * (2 * NG)
        ks_a = tl.load(cache_f16 + ksm + 2 * GA).to(tl.float32)
        km_a = tl.load(cache_f16 + ksm + 2 * GA + 1).to(tl.float32)
        ks_b = tl.load(cache_f16 + ksm + 2 * GB).to(tl.float32)
        km_b = tl.load(cache_f16 + ksm + 2 * GB + 1).to(tl.float32)
        vs_a = tl.load(cache_f16 + vsm + 2 * GA).to(tl.float32)
        vm_a = tl.load(cache_f16 + vsm + 2 * GA + 1).to(tl.float32)
        vs_b = tl.load(cache_f16 + vsm + 2 * GB).to(tl.float32)
        vm_b = tl.load(cache_f16 + vsm + 2 * GB + 1).to(tl.float32)
        # rows past the range may hold stale bytes: keep them out of p * s
        vs_a = tl.where(ok, vs_a, 0.0)
        vm_a = tl.where(ok, vm_a, 0.0)
        vs_b = tl.where(ok, vs_b, 0.0)
        vm_b = tl.where(ok, vm_b, 0.0)

        dot_a = tl.dot(q0, tl.trans(_codes_plus_1024(kc, 0))) + tl.dot(q1, tl.trans(_codes_plus_1024(kc, 2)))
        dot_b = tl.dot(q2, tl.trans(_codes_plus_1024(kc, 4))) + tl.dot(q3, tl.trans(_codes_plus_1024(kc, 6)))
        s = ((dot_a - 1024.0 * qsa[:, None]) * ks_a[None, :] + qsa[:, None] * km_a[None, :]
             + (dot_b - 1024.0 * qsb[:, None]) * ks_b[None, :] + qsb[:, None] * km_b[None, :])
        s = tl.where(ok[None, :], s, float("-inf"))

        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)

        pa = (p * vs_a[None, :]).to(tl.float16)
        pb = (p * vs_b[None, :]).to(tl.float16)
        off_a = tl.sum(p * vm_a[None, :], axis=1) - 1024.0 * tl.sum(pa.to(tl.float32), axis=1)
        off_b = tl.sum(p * vm_b[None, :], axis=1) - 1024.0 * tl.sum(pb.to(tl.float32), axis=1)
        a0 = a0 * alpha[:, None] + tl.dot(pa, _codes_plus_1024(vc, 0)) + off_a[:, None]
        a1 = a1 * alpha[:, None] + tl.dot(pa, _codes_plus_1024(vc, 2)) + off_a[:, None]
        a2 = a2 * alpha[:, None] + tl.dot(pb, _codes_plus_1024(vc, 4)) + off_b[:, None]
        a3 = a3 * alpha[:, None] + tl.dot(pb, _codes_plus_1024(vc, 6)) + off_b[:, None]

    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    tl.store(o_base[:, None] + d4[None, :], a0 * inv[:, None], mask=qmask[:, None])
    tl.store(o_base[:, None] + D4 + d4[None, :], a1 * inv[:, None], mask=qmask[:, None])
    tl.store(o_base[:, None] + 2 * D4 + d4[None, :], a2 * inv[:, None], mask=qmask[:, None])
    tl.store(o_base[:, None] + 3 * D4 + d4[None, :], a3 * inv[:, None], mask=qmask[:, None])
    tl.store(lse_ptr, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")), mask=qmask)


@triton.jit
def _bf16_rows(q_base, qmask, row, cache_bf16, o_base, lse_ptr, L,
               H, h, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, SINK: tl.constexpr,
               WINDOW: tl.constexpr, ROWS: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr):
    NG: tl.constexpr = D // G
    HALF_BLOCK: tl.constexpr = KB * (D // 2 + 8 * NG) // 2
    d = tl.arange(0, D)
    q = tl.load(q_base[:, None] + d[None, :], mask=qmask[:, None], other=0.0).to(tl.float16)
    # ring slots fill in order, so the live slots are exactly 0 .. min(L, S0 + W)
    n_rows = tl.minimum(L, SINK + WINDOW)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for t0 in range(0, n_rows, BLOCK_N):
        slot = t0 + tl.arange(0, BLOCK_N)
        ok = slot < n_rows
        sblk = tl.load(row + slot // ROWS, mask=ok, other=0).to(tl.int64)
        sbase = (sblk * H + h) * HALF_BLOCK + (slot % ROWS) * (2 * D)
        k = tl.load(cache_bf16 + sbase[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        v = tl.load(cache_bf16 + sbase[:, None] + D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    tl.store(o_base[:, None] + d[None, :], acc * inv[:, None], mask=qmask[:, None])
    tl.store(lse_ptr, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")), mask=qmask)


@triton.jit
def _decode_kernel(q_ptr, stride_qb, stride_qh, bt_ptr, bt_stride, seq_ptr,
                   cache_u8, cache_f16, cache_bf16, o_ptr, lse_ptr,
                   H, HQ: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                   D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr,
                   SINK: tl.constexpr, WINDOW: tl.constexpr, STATE_BLOCKS: tl.constexpr,
                   ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    gi = tl.arange(0, GP)
    qmask = gi < GROUP
    hq = h * GROUP + gi
    q_base = q_ptr + b.to(tl.int64) * stride_qb + hq * stride_qh
    row = bt_ptr + b.to(tl.int64) * bt_stride
    L = tl.load(seq_ptr + b)
    part = (b * HQ + hq).to(tl.int64) * (NUM_SPLITS + 1) + split
    o_base = o_ptr + part * D
    if split < NUM_SPLITS:
        _int2_split(q_base, qmask, row, cache_u8, cache_f16, o_base, lse_ptr + part, L, split,
                    H, h, D, G, KB, SINK, WINDOW, STATE_BLOCKS, NUM_SPLITS, GP)
    else:
        _bf16_rows(q_base, qmask, row, cache_bf16, o_base, lse_ptr + part, L,
                   H, h, D, G, KB, SINK, WINDOW, ROWS, GP, BLOCK_N)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, HQ: tl.constexpr,
                  D: tl.constexpr, PARTS: tl.constexpr, PARTS_P: tl.constexpr):
    """Combine the partial outputs of one (request, query head) by their LSE."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    i = tl.arange(0, PARTS_P)
    d = tl.arange(0, D)
    part = (b * HQ + hq).to(tl.int64) * PARTS + i
    lse = tl.load(lse_ptr + part, mask=i < PARTS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    o = tl.load(o_ptr + part[:, None] * D + d[None, :], mask=(i < PARTS)[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def num_splits(batch: int, kv_heads: int, max_context: int, sm_count: int, block_size: int = 128) -> int:
    """INT2 splits per (request, KV head): about eight programs per SM, each
    slice at least two pages long."""
    want = math.ceil(8 * sm_count / max(batch * kv_heads, 1))
    longest = max(1, max_context // (2 * block_size))
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
    ``launch``: Triton launch options (num_warps, num_stages), default LAUNCH."""
    b, hq, d = q.shape
    h = kv_cache.shape[1]
    group = hq // h
    if fmt.groups not in (1, 2) or fmt.block_size < 16:
        raise ValueError(
            f"OSCAR Triton decode needs group_size head_size or head_size/2 and block_size >= 16, "
            f"got {fmt.group_size} and {fmt.block_size}")
    if b == 0:
        return out
    parts = splits + 1
    o_part = torch.empty(b, hq, parts, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b, hq, parts, dtype=torch.float32, device=q.device)
    qs = (q.float() * (scale * LOG2E)).contiguous()
    _decode_kernel[(b, h, parts)](
        qs, qs.stride(0), qs.stride(1), block_table, block_table.stride(0), seq_lens,
        kv_cache, kv_cache.view(torch.float16), kv_cache.view(torch.bfloat16), o_part, lse_part,
        h, HQ=hq, GROUP=group, GP=max(16, triton.next_power_of_2(group)),
        D=d, G=fmt.group_size, KB=fmt.block_size, SINK=fmt.sink, WINDOW=fmt.window,
        STATE_BLOCKS=fmt.state_blocks, ROWS=fmt.state_rows_per_block, NUM_SPLITS=splits, BLOCK_N=64,
        **(launch or LAUNCH),
    )
    _merge_kernel[(b, hq)](o_part, lse_part, out, out.stride(0), out.stride(1), HQ=hq, D=d,
                           PARTS=parts, PARTS_P=triton.next_power_of_2(parts))
    return out
