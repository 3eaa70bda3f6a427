"""Fused OSCAR write path: rotate K, clip, quantize, pack, and store BF16
sink/window rows, in one launch per layer.

Twin of :func:`reference.write_request` (plus the K rotation and the
quantizer of :func:`reference.quantize_rows`) for every token of a batch at
once. Each program handles ``BLOCK_T`` tokens of one KV head.

A token at position -1 (its request has length 0: the padding vLLM adds to a
batch replayed from a CUDA graph) or with a negative slot writes nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.oscar.format import OscarFormat

# tokens per program and warps, decode batches and prefill chunks alike: the best of
# the H200 sweep at head size 128 (benchmarks/results/oscar_kernels.json)
LAUNCH = {"block_t": 16, "num_warps": 4}


def default_launch(head_size: int) -> dict:
    """The launch for ``head_size``: twice the warps per doubling past 128 (the
    rotation's [block_t, D] tiles; rotated head size 256 then compiles without
    spills for sm_90a; sized by registers, not timed)."""
    return {**LAUNCH, "num_warps": LAUNCH["num_warps"] * (max(head_size, 128) // 128)}


def _compiled(x: torch.Tensor) -> bool:
    """True where Triton compiles for a GPU (not in its interpreter)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


@triton.jit
def _clip_pair(k, v, k_above, v_above):
    """Clamp each row of ``k`` and ``v`` (``[T, D]`` fp32 holding bf16 values)
    at its ``|x|`` order statistic with ``*_above`` entries above it
    (``sort(|x|)[D - 1 - above]``; no clip where ``above < 0``).

    Radix select on the 15 magnitude bits of a bf16: the threshold is the
    largest pattern ``c`` with more than ``above`` entries ``>= c``, built one
    bit at a time (ties count as a sort counts them). K and V run as the two
    16-bit lanes of one int32: with ``0x8000`` set in each lane,
    ``(|x| | 0x8000) - c`` keeps bit 15 of a lane iff ``|x| >= c`` and never
    borrows across lanes, so one subtract, shift and mask compare two entries
    and one row sum counts both.
    """
    ak = (k.to(tl.int32, bitcast=True) >> 16) & 0x7FFF
    av = (v.to(tl.int32, bitcast=True) >> 16) & 0x7FFF
    akv = ak | (av << 16) | -2147450880  # | 0x80008000
    pk = tl.zeros([k.shape[0]], tl.int32)
    pv = tl.zeros([k.shape[0]], tl.int32)
    bit = 1 << 14
    for _ in tl.static_range(15):
        ck = pk | bit
        cv = pv | bit
        hits = ((akv - (ck | (cv << 16))[:, None]) >> 15) & 0x10001
        n = tl.sum(hits, axis=1)
        pk = tl.where((n & 0xFFFF) > k_above, ck, pk)
        pv = tl.where((n >> 16) > v_above, cv, pv)
        bit = bit >> 1
    tk = (pk << 16).to(tl.float32, bitcast=True)
    tv = (pv << 16).to(tl.float32, bitcast=True)
    if k_above >= 0:
        k = tl.minimum(tl.maximum(k, -tk[:, None]), tk[:, None])
    if v_above >= 0:
        v = tl.minimum(tl.maximum(v, -tv[:, None]), tv[:, None])
    return k, v


@triton.jit
def _quantize_store(x, codes_ptr, sm_ptr, tok_ok, BLOCK_T: tl.constexpr, D: tl.constexpr,
                    G: tl.constexpr, CODE_STRIDE: tl.constexpr):
    """INT2 codes (quartered, 4 per byte) and fp16 (scale, min) of rows ``x``.

    ``codes_ptr [T]`` points at each row's first code byte, whose later bytes
    lie CODE_STRIDE apart (1 for K, KB for V's byte-major codes); ``sm_ptr [T]``
    at its first fp16 (scale, min) pair.
    """
    NG: tl.constexpr = D // G
    D4: tl.constexpr = D // 4
    xg = tl.reshape(x, (BLOCK_T, NG, G))
    lo = tl.min(xg, axis=2)
    hi = tl.max(xg, axis=2)
    scale = tl.maximum(tl.math.div_rn(hi - lo, 3.0), 1e-8).to(tl.float16)
    lo16 = lo.to(tl.float16)
    q = tl.math.div_rn(xg - lo16.to(tl.float32)[:, :, None], scale.to(tl.float32)[:, :, None])
    codes = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), 3.0).to(tl.int32)
    codes = tl.reshape(codes, (BLOCK_T, 4, D4))
    shifts = (tl.arange(0, 4) * 2)[None, :, None]
    packed = tl.sum(codes << shifts, axis=1).to(tl.uint8)
    tl.store(codes_ptr[:, None] + tl.arange(0, D4)[None, :] * CODE_STRIDE, packed, mask=tok_ok[:, None])
    grp = tl.arange(0, NG)
    tl.store(sm_ptr[:, None] + 2 * grp[None, :], scale, mask=tok_ok[:, None])
    tl.store(sm_ptr[:, None] + 2 * grp[None, :] + 1, lo16, mask=tok_ok[:, None])


@triton.jit
def _store_kernel(
    k_ptr, v_ptr, rot_ptr, k_out_ptr,
    pos_ptr, req_ptr, end_ptr, slot_ptr, bt_ptr, bt_stride,
    cache_u8, cache_f16, cache_bf16,
    n_tokens, k_clip_above, v_clip_above,
    stride_kt, stride_kh, stride_vt, stride_vh,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr, STATE_BLOCKS: tl.constexpr, ROWS: tl.constexpr,
    ROTATE: tl.constexpr, DATA: tl.constexpr, STATE: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT_PRECISION: tl.constexpr, DECODE: tl.constexpr, SLOTS: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    NG: tl.constexpr = D // G
    D4: tl.constexpr = D // 4
    BLOCK_BYTES: tl.constexpr = KB * (D // 2 + 8 * NG)

    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < n_tokens
    cols = tl.arange(0, D)
    k_rows = k_ptr + tok[:, None] * stride_kt + h * stride_kh
    v = tl.load(v_ptr + tok[:, None] * stride_vt + h * stride_vh + cols[None, :], mask=tok_ok[:, None], other=0.0)
    if ROTATE:
        # k @ R in slices of RC input dims: a [RC, D] slice of R at a time
        # keeps registers low; tf32x3 on the tensor cores is fp32-accurate
        RC: tl.constexpr = 32
        rc = tl.arange(0, RC)
        k = tl.zeros([BLOCK_T, D], tl.float32)
        for c in tl.static_range(D // RC):
            kc = tl.load(k_rows + c * RC + rc[None, :], mask=tok_ok[:, None], other=0.0).to(tl.float32)
            r = tl.load(rot_ptr + h * D * D + (c * RC + rc)[:, None] * D + cols[None, :])
            k = tl.dot(kc, r, k, input_precision=ROT_PRECISION)
    else:
        k = tl.load(k_rows + cols[None, :], mask=tok_ok[:, None], other=0.0).to(tl.float32)
    # The cache stores what a BF16 model would: rows rounded to bf16 first.
    k_bf = k.to(tl.bfloat16)
    v_bf = v.to(tl.bfloat16)
    if ROTATE:
        tl.store(k_out_ptr + tok[:, None] * (H * D) + h * D + cols[None, :], k_bf, mask=tok_ok[:, None])

    if DECODE:  # token t is the one query token of request t, at position seq_len - 1
        req = tok
        end = tl.load(end_ptr + tok, mask=tok_ok, other=0)
        pos = end - 1
    else:
        pos = tl.load(pos_ptr + tok, mask=tok_ok, other=-1)
        req = tl.load(req_ptr + tok, mask=tok_ok, other=0)
        end = tl.load(end_ptr + tok, mask=tok_ok, other=0)
    # padding: no position (a request of length 0) or no slot writes nothing
    live = tok_ok & (pos >= 0)
    if SLOTS:
        live = live & (tl.load(slot_ptr + tok, mask=tok_ok, other=-1) >= 0)
    row = bt_ptr + req.to(tl.int64) * bt_stride

    if DATA:  # INT2 rows in the data block of each position
        blk = tl.load(row + STATE_BLOCKS + pos // KB, mask=live, other=0).to(tl.int64)
        off = pos % KB
        base = (blk * H + h) * BLOCK_BYTES
        kq, vq = _clip_pair(k_bf.to(tl.float32), v_bf.to(tl.float32), k_clip_above, v_clip_above)
        _quantize_store(kq, cache_u8 + base + off * D4,
                        cache_f16 + (base + KB * (D // 2) + off * 4 * NG) // 2, live, BLOCK_T, D, G, 1)
        _quantize_store(vq, cache_u8 + base + KB * D4 + off,
                        cache_f16 + (base + KB * (D // 2) + KB * 4 * NG + off * 4 * NG) // 2,
                        live, BLOCK_T, D, G, KB)

    if STATE:  # BF16 rows of the sink and of the last W positions of this chunk
        keep = live & ((pos < SINK) | (pos >= tl.maximum(end - WINDOW, SINK)))
        slot = tl.where(pos < SINK, pos, SINK + (pos - SINK) % RING)
        sblk = tl.load(row + slot // ROWS, mask=keep, other=0).to(tl.int64)
        srow = slot % ROWS
        sbase = (sblk * H + h) * (BLOCK_BYTES // 2) + srow * (2 * D)
        tl.store(cache_bf16 + sbase[:, None] + cols[None, :], k_bf, mask=keep[:, None])
        tl.store(cache_bf16 + sbase[:, None] + D + cols[None, :], v_bf, mask=keep[:, None])


def entries_above_clip(ratio: float, d: int) -> int:
    """How many entries of a row lie above the order statistic that
    :func:`reference.clip_rows` clamps at (-1: no clip)."""
    return -1 if ratio >= 1.0 else d - 1 - min(int(ratio * d), d - 1)


def store_tokens(
    kv_cache: torch.Tensor,
    fmt: OscarFormat,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rotation: torch.Tensor | None,
    positions: torch.Tensor,
    request: torch.Tensor,
    seq_end: torch.Tensor,
    block_table: torch.Tensor,
    k_clip: float,
    v_clip: float,
    data: bool = True,
    state: bool = True,
    launch: dict | None = None,
) -> torch.Tensor:
    """Rotate ``k`` (``[N, H, D]``, unrotated) by ``k_rotation [H, D, D]`` and
    store ``k, v`` of every token in the paged cache.

    Per token: its ``positions``, ``request`` (row of ``block_table``) and
    ``seq_end`` (that request's length after this step). Returns the rotated
    keys in bf16 ``[N, H, D]`` (``k`` itself when there is no rotation).

    ``data``/``state`` select the INT2 rows and the BF16 sink/window rows;
    ``launch``: ``{"block_t", "num_warps"}`` over :func:`default_launch`. A
    multi-token chunk stores its INT2 rows, attends, then stores its BF16 rows:
    its early queries still need the ring rows its later tokens overwrite.
    """
    return _launch(kv_cache, fmt, k, v, k_rotation, positions, request, seq_end, None, block_table,
                   k_clip, v_clip, data, state, launch)


def store_decode_tokens(
    kv_cache: torch.Tensor,
    fmt: OscarFormat,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rotation: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    k_clip: float,
    v_clip: float,
    slot_mapping: torch.Tensor | None = None,
    launch: dict | None = None,
) -> torch.Tensor:
    """:func:`store_tokens` for a batch of single-token requests: token ``i``
    is request ``i``'s, at position ``seq_lens[i] - 1``.

    Reads nothing but device tensors (no per-step index), so a CUDA graph that
    captured it replays any batch written into the same ``seq_lens``,
    ``block_table`` and ``slot_mapping`` buffers. Tokens of length-0 requests
    and, with ``slot_mapping``, tokens whose slot is negative (vLLM's padding
    and dummy batches) write nothing.
    """
    return _launch(kv_cache, fmt, k, v, k_rotation, None, None, seq_lens, slot_mapping, block_table,
                   k_clip, v_clip, True, True, launch)


def _launch(kv_cache, fmt, k, v, k_rotation, positions, request, seq_end, slot_mapping, block_table,
            k_clip, v_clip, data, state, launch) -> torch.Tensor:
    n, h, d = k.shape
    if not kv_cache.is_contiguous():
        raise ValueError("OSCAR pages must be one contiguous [blocks, H, KB, C] tensor per layer")
    if n == 0:
        return k
    rotate = k_rotation is not None
    if rotate:
        k_rotation = k_rotation.to(torch.float32).contiguous()
    k_out = torch.empty(n, h, d, dtype=torch.bfloat16, device=k.device) if rotate else k
    lc = {**default_launch(d), **(launch or {})}
    block_t = lc.pop("block_t")
    grid = (triton.cdiv(n, block_t), h)
    decode = positions is None
    _store_kernel[grid](
        k, v, k_rotation if rotate else k, k_out,
        seq_end if decode else positions, seq_end if decode else request, seq_end,
        seq_end if slot_mapping is None else slot_mapping, block_table, block_table.stride(0),
        kv_cache, kv_cache.view(torch.float16), kv_cache.view(torch.bfloat16),
        n, entries_above_clip(k_clip, d), entries_above_clip(v_clip, d),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=h, D=d, G=fmt.group_size, KB=fmt.block_size,
        SINK=fmt.sink, WINDOW=fmt.window, RING=max(fmt.window, 1), STATE_BLOCKS=fmt.state_blocks, ROWS=fmt.state_rows_per_block,
        ROTATE=rotate, DATA=data, STATE=state, BLOCK_T=block_t,
        ROT_PRECISION="tf32x3" if _compiled(k) else "ieee", DECODE=decode, SLOTS=slot_mapping is not None, **lc,
    )
    return k_out
