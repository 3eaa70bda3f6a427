"""Fused STEPQuant decode step: unpack, gated delta update, readout, fit and
repack of every (request, value head) in one program.

Twin of :func:`reference.step`. One program owns one head of one request and
holds its whole ``K x V`` state in registers, so the row statistics (mean
``|X|`` over V) and the column statistics (``Sᵀk``, ``Xᵀq``, absmax and the
weighted refit over K) are all local: no scratch, no second kernel, no host
sync (CUDA-graph safe). The record is rewritten in place: no other program
touches that (slot, head), and inside the program every load of the record
comes before a cross-warp column sum, which comes before every store.

Records live in a pool ``[slots, size]`` of uint8 whose slot stride may be
larger than the record (vLLM's state view: the record sits inside a larger
hybrid page, after the conv state); ``state_indices [N]`` (any stride, e.g.
a column of vLLM's block table) names each request's slot, and requests whose
index is below ``min_slot`` (vLLM's padding and null slot 0: ``min_slot=1``)
get a zero output and touch nothing. One launch per width present in the
layer, the width a constexpr, so each instance carries only its own
unpack/fit code.

The fit is the plan's: ``stepquant`` (the dual-axis fit with the impact
factors) or ``rowwise`` (the uniform baseline: one absmax scale per key row,
unit column scales), as in :func:`reference.fit_heads`.

``fast=True`` (the default) multiplies by reciprocals of the row and column
scales instead of dividing every element, folds the decay into the row
factors and uses the hardware sqrt/divide for the per-row/column scale math;
``fast=False`` keeps the reference's correctly rounded divisions element by
element (from correctly rounded reciprocals and one FMA correction). Either
way codes differ from the reference's only where a value sits within an ulp
or two of a rounding boundary (sums also run in another order); the tests
bound that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_kvq.kernels.stepquant.format import INT2_GROUP, PIVOT, StateLayout


@triton.jit
def _fp16_round(x):
    return tl.minimum(tl.maximum(x, 5.960464477539063e-08), 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def _div(x, d, d_inv):
    """``x / d`` correctly rounded from ``d_inv = 1 / d`` (itself correctly
    rounded): one Newton correction with exact FMA residuals (Markstein), three
    operations an element instead of a full IEEE division."""
    q = x * d_inv
    return tl.fma(tl.fma(-q, d, x), d_inv, q)


@triton.jit
def _levels(t, BITS: tl.constexpr):
    """Nearest signed level of ``t`` (``reference.quantize_levels``) as a float,
    and its unsigned code as int32.

    No float<->int conversions (a quarter-rate pipe): adding 1.5 * 2**23 to the
    clamped value rounds it half to even, like torch.round, and leaves the
    integer in the low mantissa bits.
    """
    if BITS == 2:
        pos = t >= 0
        big = tl.abs(t) >= 2.0
        z = tl.where(pos, 1.0, -1.0) * tl.where(big, 3.0, 1.0)
        u = tl.where(pos, tl.where(big, 3, 2), tl.where(big, 0, 1))
    else:
        QM: tl.constexpr = (1 << (BITS - 1)) - 1
        f = tl.minimum(tl.maximum(t, -QM * 1.0), QM * 1.0) + 12582912.0
        z = f - 12582912.0
        u = f.to(tl.int32, bitcast=True) - (0x4B400000 - QM)
    return z, u


@triton.jit
def _signed(u, BITS: tl.constexpr):
    """Signed level (float) of unsigned codes ``u`` (int32), without an int->float conversion."""
    f = (u | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + u
    if BITS == 2:
        z = (f - 8388608.0) * 2.0 - 3.0
    else:
        z = f - (8388608.0 + ((1 << (BITS - 1)) - 1))
    return z


@triton.jit
def _unpack(base, a3, i3, b3, BITS: tl.constexpr, V: tl.constexpr):
    """Unsigned codes (int32) ``[4, K, V/4]`` of the packed head at ``base``
    (uint8 pointer): element (a, i, b) is column ``4 b + a`` of key row i, so
    each thread holds 4 consecutive codes of a row (one 6-bit group, one
    2-bit byte, two 4-bit bytes) and unpacks them from its own bytes."""
    if BITS == 8:
        u = tl.load(base + i3 * V + 4 * b3 + a3).to(tl.int32)
    elif BITS == 6:  # 4 codes in the 24-bit word at byte 3 b of the row
        at = base + i3 * (3 * V // 4) + 3 * b3
        word = (tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 8)
                | (tl.load(at + 2).to(tl.int32) << 16))
        u = (word >> (6 * a3)) & 63
    elif BITS == 4:  # byte 2 b + a // 2, low nibble first
        u = (tl.load(base + i3 * (V // 2) + 2 * b3 + a3 // 2).to(tl.int32) >> (4 * (a3 % 2))) & 15
    else:  # byte b, bits 0-1 first
        u = (tl.load(base + i3 * (V // 4) + b3).to(tl.int32) >> (2 * a3)) & 3
    return u


@triton.jit
def _pack_store(u, base, a3, i3, b3, K: tl.constexpr, V: tl.constexpr, BITS: tl.constexpr):
    """Store unsigned codes ``u [4, K, V/4]`` (int32) packed at ``base``; the
    codes of one byte (of one 24-bit word) sit in one thread."""
    L: tl.constexpr = V // 4
    if BITS == 8:
        tl.store(base + i3 * V + 4 * b3 + a3, u.to(tl.uint8))
    elif BITS == 4:
        byte = tl.sum(tl.reshape(u << (4 * (a3 % 2)), (2, 2, K, L)), axis=1)  # disjoint bits: sum == or
        i = tl.arange(0, K)[None, :, None]
        b = tl.arange(0, L)[None, None, :]
        h = tl.arange(0, 2)[:, None, None]
        tl.store(base + i * (V // 2) + 2 * b + h, byte.to(tl.uint8))
    else:
        word = tl.sum(u << (BITS * a3), axis=0)  # [K, L]
        i = tl.arange(0, K)[:, None]
        b = tl.arange(0, L)[None, :]
        if BITS == 6:
            at = base + i * (3 * V // 4) + 3 * b
            tl.store(at, (word & 255).to(tl.uint8))
            tl.store(at + 1, ((word >> 8) & 255).to(tl.uint8))
            tl.store(at + 2, ((word >> 16) & 255).to(tl.uint8))
        else:
            tl.store(base + i * (V // 4) + b, word.to(tl.uint8))


@triton.jit
def _group_rows(t, K: tl.constexpr, L: tl.constexpr):
    """``t [K, L]`` summed over each INT2 group (8 lanes = 32 columns) and
    broadcast back: the per-group row sums, ``[K, L]``."""
    G: tl.constexpr = L // 8
    s = tl.sum(tl.reshape(t, (K, G, 8)), axis=2)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (K, G, 8)), (K, L))


@triton.jit
def _head_step(
    rec, rec16, w_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    codes_off, rows_off, cols_off,
    BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, FAST: tl.constexpr, FIT: tl.constexpr,
    ROWWISE: tl.constexpr,
):
    """The whole step of one head: ``rec``/``rec16`` point at the record (uint8
    / fp16 views), the others at this (request, head)'s inputs and output.

    The state is held as ``[4, K, V/4]``, element (a, i, b) = X[i, 4 b + a]:
    registers hold the 4 consecutive columns (packing stays in a thread), lanes
    the column quads, warps the key rows. Column sums (over K) then run inside
    a thread and across warps, row sums over one warp.
    """
    L: tl.constexpr = V // 4
    a3 = tl.arange(0, 4)[:, None, None]
    i3 = tl.arange(0, K)[None, :, None]
    b3 = tl.arange(0, L)[None, None, :]
    col2 = 4 * tl.arange(0, L)[None, :] + tl.arange(0, 4)[:, None]  # [4, L] column index
    rows = tl.arange(0, K)
    kk = tl.load(k_ptr + rows).to(tl.float32)[None, :, None]
    qq = tl.load(q_ptr + rows).to(tl.float32)[None, :, None]
    vv = tl.load(v_ptr + col2).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr).to(tl.float32))
    beta = tl.load(beta_ptr).to(tl.float32)

    # Reconstruct the decayed state S = exp(g) * r c z (or the fp16 pivot).
    if BITS == 16:
        x_hat = tl.load(rec16 + codes_off // 2 + i3 * V + 4 * b3 + a3).to(tl.float32)
    else:
        z = _signed(_unpack(rec + codes_off, a3, i3, b3, BITS, V), BITS)
        if BITS == 2:  # one row factor per 32-column group: lanes b // 8
            r = tl.load(rec16 + rows_off // 2 + rows[:, None] * (V // 32) + tl.arange(0, L)[None, :] // 8)
            r = r.to(tl.float32)[None, :, :]  # [1, K, L]
        else:
            r = tl.load(rec16 + rows_off // 2 + rows).to(tl.float32)[None, :, None]  # [1, K, 1]
        if FAST:  # the decay folded into the row factors: one multiply less per element
            r = decay * r
        c = tl.load(rec16 + cols_off // 2 + col2).to(tl.float32)
        x_hat = (r * c[:, None, :]) * z
    if FAST and BITS != 16:
        s = x_hat
    else:
        s = decay * x_hat

    # Gated delta rule and the readout from the unquantized X.
    resid = vv - tl.sum(s * kk, axis=1)
    x = s + kk * (beta * resid)[:, None, :]
    tl.store(out_ptr + col2, tl.sum(x * qq, axis=1))

    if not FIT:  # measuring only: the record stays as it was
        pass
    elif BITS == 16:
        tl.store(rec16 + codes_off // 2 + i3 * V + 4 * b3 + a3, x.to(tl.float16))
    elif ROWWISE:  # the uniform baseline: r_i = max_j |X_ij| / qmax, c = 1 (no INT2 form)
        QMR: tl.constexpr = (1 << (BITS - 1)) - 1
        r = _fp16_round(tl.math.div_rn(tl.max(tl.max(tl.abs(x), axis=0), axis=1), QMR * 1.0))  # [K]
        r3 = r[None, :, None]
        if FAST:
            _, u = _levels(x * (1.0 / r3), BITS)
        else:
            _, u = _levels(_div(x, r3, tl.math.div_rn(1.0, r3)), BITS)
        tl.store(rec16 + rows_off // 2 + rows, r.to(tl.float16))
        tl.store(rec16 + cols_off // 2 + col2, tl.full((4, L), 1.0, tl.float16))
        _pack_store(u, rec + codes_off, a3, i3, b3, K, V, BITS)
    else:
        QM: tl.constexpr = 3 if BITS == 2 else (1 << (BITS - 1)) - 1
        # 1. row factors from mean |X| (per 32-column group for INT2) and the impact
        if BITS == 2:
            w = tl.load(w_ptr + rows)[:, None]  # [K, 1]
            mag = tl.maximum(_group_rows(tl.sum(tl.abs(x), axis=0), K, L) * (1.0 / 32), 1e-20)  # [K, L]
        else:
            w = tl.load(w_ptr + rows)  # [K]
            mag = tl.maximum(tl.sum(tl.sum(tl.abs(x), axis=0), axis=1) * (1.0 / V), 1e-20)  # [K]
        if FAST:
            r = _fp16_round(tl.sqrt(mag / w))
        else:
            r = _fp16_round(tl.sqrt_rn(tl.math.div_rn(mag, w)))
        if BITS == 2:
            r3 = r[None, :, :]
            w3 = w[None, :, :]
        else:
            r3 = r[None, :, None]
            w3 = w[None, :, None]
        if FAST:
            # 2. column scales by absmax; 3. one w²-weighted least-squares refit
            y = x * (1.0 / r3)
            c0 = _fp16_round(tl.max(tl.abs(y), axis=1) * (1.0 / QM))
            z0, _ = _levels(y * (1.0 / c0)[:, None, :], BITS)
            # in units of y (x ~ r y): sum w² r² z0 y and sum w² r² z0², 3 ops an element instead of 5
            p = (w3 * r3) * (w3 * r3) * z0
            num = tl.sum(p * y, axis=1)
            den = tl.sum(p * z0, axis=1)
            c = tl.where(den > 0, _fp16_round(num / tl.maximum(den, 1e-30)), c0)
            _, u = _levels(y * (1.0 / c)[:, None, :], BITS)
        else:
            y = _div(x, r3, tl.math.div_rn(1.0, r3))
            c0 = _fp16_round(tl.math.div_rn(tl.max(tl.abs(y), axis=1), QM * 1.0))
            z0, _ = _levels(_div(y, c0[:, None, :], tl.math.div_rn(1.0, c0)[:, None, :]), BITS)
            vals = r3 * z0
            w2 = w3 * w3
            num = tl.sum(w2 * vals * x, axis=1)
            den = tl.sum(w2 * vals * vals, axis=1)
            c = tl.where(den > 0, _fp16_round(tl.math.div_rn(num, tl.maximum(den, 1e-30))), c0)
            _, u = _levels(_div(y, c[:, None, :], tl.math.div_rn(1.0, c)[:, None, :]), BITS)
        if BITS == 2:  # lanes 8 g .. 8 g + 7 all hold group g: store from the first
            lane = tl.arange(0, L)[None, :]
            tl.store(rec16 + rows_off // 2 + rows[:, None] * (V // 32) + lane // 8, r.to(tl.float16),
                     mask=(lane % 8) == 0)
        else:
            tl.store(rec16 + rows_off // 2 + rows, r.to(tl.float16))
        tl.store(rec16 + cols_off // 2 + col2, c.to(tl.float16))
        _pack_store(u, rec + codes_off, a3, i3, b3, K, V, BITS)


@triton.jit
def _step_kernel(
    pool, pool16, idx_ptr, s_idx, slot_stride, min_slot,
    heads_ptr, codes_ptr, rows_ptr, cols_ptr,
    w_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    sqn, sqh, skn, skh, svn, svh, sgn, sgh, sbn, sbh,
    H, QK_GROUP,
    BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, FAST: tl.constexpr, ALIGN: tl.constexpr,
    FIT: tl.constexpr, ROWWISE: tl.constexpr,
):
    """Program (j, n): head ``heads[j]`` (width ``BITS``) of request n, whose
    record starts at byte ``slot * slot_stride`` of the pool. The slot stride
    and head offsets are multiples of ``ALIGN`` bytes (vector loads)."""
    j = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    h = tl.load(heads_ptr + j)
    out = out_ptr + (n * H + h) * V
    slot = tl.load(idx_ptr + n * s_idx).to(tl.int64)
    if slot < min_slot:
        tl.store(out + tl.arange(0, V), tl.zeros((V,), tl.float32))
    else:
        base = tl.multiple_of(slot * slot_stride, ALIGN)
        rec = pool + base
        rec16 = pool16 + base // 2
        qp = q_ptr + n * sqn + (h // QK_GROUP) * sqh
        kp = k_ptr + n * skn + (h // QK_GROUP) * skh
        vp = v_ptr + n * svn + h * svh
        gp = g_ptr + n * sgn + h * sgh
        bp = beta_ptr + n * sbn + h * sbh
        wp = w_ptr + h * K
        co = tl.multiple_of(tl.load(codes_ptr + j), ALIGN)
        ro = tl.multiple_of(tl.load(rows_ptr + j), ALIGN)
        cl = tl.multiple_of(tl.load(cols_ptr + j), ALIGN)
        _head_step(rec, rec16, wp, qp, kp, vp, gp, bp, out, co, ro, cl, BITS, K, V, FAST, FIT, ROWWISE)


LAST_KERNELS: list = []  # (width, compiled kernel) of the last step_ call: registers and spills for the benchmark
FITS = ("stepquant", "rowwise")


@dataclass
class _Group:
    bits: int
    heads: torch.Tensor
    codes: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


class StepPlan:
    """Device-side head tables of one layer's layout and its fit (``stepquant``
    or ``rowwise``, as in :func:`reference.fit_heads`), built once (not per step)."""

    def __init__(self, layout: StateLayout, impact: torch.Tensor, device: torch.device | str,
                 fit: str = "stepquant"):
        k, v = layout.k_dim, layout.v_dim
        if k & (k - 1) or v & (v - 1) or min(k, v) < INT2_GROUP:
            raise ValueError(f"the Triton step needs power-of-two K and V >= {INT2_GROUP}, got K={k} V={v}")
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
        if fit == "rowwise" and 2 in layout.bits:
            raise ValueError("the rowwise fit has no INT2 form (INT2 keeps one row factor per 32 columns)")
        self.layout = layout
        self.rowwise = fit == "rowwise"
        self.impact = impact.to(device=device, dtype=torch.float32).contiguous()
        slots = layout.heads

        def group(bits: int, ids: list[int]) -> _Group:
            col = lambda f: torch.tensor([f(i) for i in ids], dtype=torch.int32, device=device)  # noqa: E731
            return _Group(bits, col(lambda i: i), col(lambda i: slots[i].codes), col(lambda i: slots[i].rows),
                          col(lambda i: slots[i].cols))

        # widest first: the pivot and 8-bit programs are the longest, start them early
        order = sorted(set(layout.bits), reverse=True)
        self.groups = [group(b, [i for i, x in enumerate(layout.bits) if x == b]) for b in order]


def step_(
    pool: torch.Tensor,
    state_indices: torch.Tensor,
    plan: StepPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    out: torch.Tensor | None = None,
    min_slot: int = 1,
    fast: bool = True,
    num_warps: int | None = None,
    readout_only: bool = False,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """Decode one token per request on the packed pool ``[slots, size]``, in place.

    ``pool`` is uint8 with a unit byte stride inside a record and any even
    slot stride (a view into vLLM's hybrid pages is fine); ``state_indices
    [N]`` any integer vector. ``q, k [N, H or H_k, K]`` (key heads are shared
    by ``H / H_k`` consecutive value heads), ``v [N, H, V]``, ``g, beta [N,
    H]``, any strides with a contiguous last dimension. Returns ``out [N, H,
    V]`` fp32, or writes the given contiguous ``out`` (fp32, bf16 or fp16).
    ``readout_only`` stops after the readout and leaves the records alone (to
    time the fit's share); ``maxnreg`` caps registers per thread (two programs
    per SM at 8 warps and 128, at the price of spills).
    """
    lay = plan.layout
    n, h = v.shape[0], len(lay.bits)
    kd, vd = lay.k_dim, lay.v_dim
    if (pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != lay.size or pool.stride(1) != 1
            or (pool.shape[0] > 1 and pool.stride(0) < lay.size)):
        raise ValueError(f"pool must be uint8 [slots, {lay.size}] with unit stride inside a record, got "
                         f"{tuple(pool.shape)} {pool.dtype} strides {pool.stride()}")
    slot_stride = pool.stride(0)
    if slot_stride % 2 or pool.storage_offset() % 2:
        raise ValueError(f"the pool's slot stride ({slot_stride}) and offset ({pool.storage_offset()}) must be even "
                         "(records hold fp16 scales)")
    if state_indices.dim() != 1 or state_indices.shape[0] < n or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be an int32/int64 vector of at least {n} slots, got "
                         f"{tuple(state_indices.shape)} {state_indices.dtype}")
    if q.shape[1] != k.shape[1] or h % q.shape[1]:
        raise ValueError(f"q/k heads {q.shape[1]}/{k.shape[1]} must divide the {h} value heads")
    if out is None:
        out = torch.empty(n, h, vd, dtype=torch.float32, device=v.device)
    elif (out.shape != (n, h, vd) or not out.is_contiguous()
          or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"out must be a contiguous float [{n}, {h}, {vd}] tensor, got {tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dimension")
    nw = num_warps or (8 if kd * vd >= 8192 else 4)
    head = (pool, pool.view(torch.float16), state_indices, state_indices.stride(0), slot_stride, min_slot)
    tail = (plan.impact, q, k, v, g, beta, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), h, h // q.shape[1])
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    LAST_KERNELS.clear()
    for grp in plan.groups:
        kern = _step_kernel[(grp.heads.numel(), n)](
            *head, grp.heads, grp.codes, grp.rows, grp.cols, *tail,
            BITS=grp.bits, K=kd, V=vd, FAST=fast, ALIGN=4 if slot_stride % 4 == 0 else 2, FIT=not readout_only,
            ROWWISE=plan.rowwise, num_warps=nw, **extra)
        LAST_KERNELS.append((grp.bits, kern))
    return out


def step(records, layout, impact, q, k, v, g, beta, plan: StepPlan | None = None, fit: str = "stepquant", **kw):
    """Out-of-place twin of :func:`reference.step` on gathered records ``[N, size]``."""
    plan = plan or StepPlan(layout, impact, records.device, fit)
    new = records.clone()
    idx = torch.arange(records.shape[0], dtype=torch.int32, device=records.device)
    out = step_(new, idx, plan, q, k, v, g, beta, min_slot=0, **kw)
    return out, new


__all__ = ["StepPlan", "step_", "step", "PIVOT", "FITS"]
