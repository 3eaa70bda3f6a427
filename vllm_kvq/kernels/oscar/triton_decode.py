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


@triton.jit
def _quarter_scores(qj, qsum_j, codes, SHIFT: tl.constexpr, s, m):
    """Scores of one quarter of the head dim: ``s * (q.code) + m * sum(q)``."""
    cj = ((codes >> SHIFT) & 3).to(tl.float16)
    dots = tl.dot(qj, tl.trans(cj))
    return dots * s[None, :] + qsum_j[:, None] * m[None, :]


@triton.jit
def _quarter_values(acc, p, alpha, codes, SHIFT: tl.constexpr, s, m):
    """``acc * alpha + p @ (code * s + m)`` for one quarter of the head dim."""
    cj = ((codes >> SHIFT) & 3).to(tl.float16)
    pv = tl.dot((p * s[None, :]).to(tl.float16), cj)
    return acc * alpha[:, None] + pv + tl.sum(p * m[None, :], axis=1)[:, None]


@triton.jit
def _int2_split(q_base, qmask, row, cache_u8, cache_f16, o_base, lse_ptr, L, split,
                H, h, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, SINK: tl.constexpr,
                WINDOW: tl.constexpr, STATE_BLOCKS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                GP: tl.constexpr, BLOCK_N: tl.constexpr):
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    BLOCK_BYTES: tl.constexpr = KB * (D // 2 + 8 * NG)
    d4 = tl.arange(0, D4)
    q0 = tl.load(q_base[:, None] + d4[None, :], mask=qmask[:, None], other=0.0)
    q1 = tl.load(q_base[:, None] + D4 + d4[None, :], mask=qmask[:, None], other=0.0)
    q2 = tl.load(q_base[:, None] + 2 * D4 + d4[None, :], mask=qmask[:, None], other=0.0)
    q3 = tl.load(q_base[:, None] + 3 * D4 + d4[None, :], mask=qmask[:, None], other=0.0)
    q0, q1, q2, q3 = q0.to(tl.float16), q1.to(tl.float16), q2.to(tl.float16), q3.to(tl.float16)
    qs0 = tl.sum(q0.to(tl.float32), axis=1)
    qs1 = tl.sum(q1.to(tl.float32), axis=1)
    qs2 = tl.sum(q2.to(tl.float32), axis=1)
    qs3 = tl.sum(q3.to(tl.float32), axis=1)
    # group of each quarter (G is a multiple of D/4)
    G0: tl.constexpr = 0
    G1: tl.constexpr = D4 // G
    G2: tl.constexpr = 2 * D4 // G
    G3: tl.constexpr = 3 * D4 // G

    lo = SINK
    hi = tl.maximum(L - WINDOW, SINK)
    per = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per
    stop = tl.minimum(start + per, hi)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([GP, D4], tl.float32)
    a1 = tl.zeros([GP, D4], tl.float32)
    a2 = tl.zeros([GP, D4], tl.float32)
    a3 = tl.zeros([GP, D4], tl.float32)
    for t0 in range(start, stop, BLOCK_N):
        pos = t0 + tl.arange(0, BLOCK_N)
        ok = pos < stop
        blk = tl.load(row + STATE_BLOCKS + pos // KB, mask=ok, other=0).to(tl.int64)
        off = pos % KB
        base = (blk * H + h) * BLOCK_BYTES
        kc = tl.load(cache_u8 + base[:, None] + off[:, None] * D4 + d4[None, :], mask=ok[:, None], other=0)
        kc = kc.to(tl.int32)
        ksm = (base + KB * (D // 2) + off * (4 * NG)) // 2
        s = _quarter_scores(q0, qs0, kc, 0, tl.load(cache_f16 + ksm + 2 * G0, mask=ok, other=0.0).to(tl.float32),
                            tl.load(cache_f16 + ksm + 2 * G0 + 1, mask=ok, other=0.0).to(tl.float32))
        s += _quarter_scores(q1, qs1, kc, 2, tl.load(cache_f16 + ksm + 2 * G1, mask=ok, other=0.0).to(tl.float32),
                             tl.load(cache_f16 + ksm + 2 * G1 + 1, mask=ok, other=0.0).to(tl.float32))
        s += _quarter_scores(q2, qs2, kc, 4, tl.load(cache_f16 + ksm + 2 * G2, mask=ok, other=0.0).to(tl.float32),
                             tl.load(cache_f16 + ksm + 2 * G2 + 1, mask=ok, other=0.0).to(tl.float32))
        s += _quarter_scores(q3, qs3, kc, 6, tl.load(cache_f16 + ksm + 2 * G3, mask=ok, other=0.0).to(tl.float32),
                             tl.load(cache_f16 + ksm + 2 * G3 + 1, mask=ok, other=0.0).to(tl.float32))
        s = tl.where(ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        vc = tl.load(cache_u8 + base[:, None] + KB * D4 + off[:, None] * D4 + d4[None, :],
                     mask=ok[:, None], other=0).to(tl.int32)
        vsm = ksm + KB * 2 * NG
        a0 = _quarter_values(a0, p, alpha, vc, 0, tl.load(cache_f16 + vsm + 2 * G0, mask=ok, other=0.0).to(tl.float32),
                             tl.load(cache_f16 + vsm + 2 * G0 + 1, mask=ok, other=0.0).to(tl.float32))
        a1 = _quarter_values(a1, p, alpha, vc, 2, tl.load(cache_f16 + vsm + 2 * G1, mask=ok, other=0.0).to(tl.float32),
                             tl.load(cache_f16 + vsm + 2 * G1 + 1, mask=ok, other=0.0).to(tl.float32))
        a2 = _quarter_values(a2, p, alpha, vc, 4, tl.load(cache_f16 + vsm + 2 * G2, mask=ok, other=0.0).to(tl.float32),
                             tl.load(cache_f16 + vsm + 2 * G2 + 1, mask=ok, other=0.0).to(tl.float32))
        a3 = _quarter_values(a3, p, alpha, vc, 6, tl.load(cache_f16 + vsm + 2 * G3, mask=ok, other=0.0).to(tl.float32),
                             tl.load(cache_f16 + vsm + 2 * G3 + 1, mask=ok, other=0.0).to(tl.float32))

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
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
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
                    H, h, D, G, KB, SINK, WINDOW, STATE_BLOCKS, NUM_SPLITS, GP, BLOCK_N)
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


def num_splits(batch: int, kv_heads: int, max_context: int, sm_count: int, block_n: int = 64) -> int:
    """INT2 splits per (request, KV head): about four programs per SM, but
    never slices shorter than four tiles."""
    want = math.ceil(4 * sm_count / max(batch * kv_heads, 1))
    longest = max(1, max_context // (4 * block_n))
    return max(1, min(want, longest, 128))


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    fmt: OscarFormat,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int,
    out: torch.Tensor,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` (rotated; position ``seq_lens - 1``, its
    own K/V already stored) over each request's cache, into ``out [B, Hq, D]``."""
    b, hq, d = q.shape
    h = kv_cache.shape[1]
    group = hq // h
    if d % 4 or fmt.group_size % (d // 4):
        raise ValueError(f"OSCAR Triton decode needs group_size a multiple of head_size/4, got {fmt.group_size}")
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
        STATE_BLOCKS=fmt.state_blocks, ROWS=fmt.state_rows_per_block, NUM_SPLITS=splits, BLOCK_N=block_n,
    )
    _merge_kernel[(b, hq)](o_part, lse_part, out, out.stride(0), out.stride(1), HQ=hq, D=d,
                           PARTS=parts, PARTS_P=triton.next_power_of_2(parts))
    return out
