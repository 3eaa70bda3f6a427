"""Fused STEPQuant decode step: unpack, gated delta update, readout, dual-axis
fit and repack of every (request, value head) in one program.

Twin of :func:`reference.step`. One program owns one head of one request and
holds its whole ``K x V`` state in registers, so the row statistics (mean
``|X|`` over V) and the column statistics (``Sᵀk``, ``Xᵀq``, absmax and the
weighted refit over K) are all local: no scratch, no second kernel, no host
sync (CUDA-graph safe). The record is rewritten in place, which is safe
because no other program reads that (slot, head).

Records live in a pool ``[slots, size]`` (uint8, one row per state slot, as
vLLM pages them); ``state_indices [N]`` names each request's slot, and
requests whose index is below ``min_slot`` (vLLM's padding and null slot 0:
``min_slot=1``) get a zero output and touch nothing.

Two launch shapes, same body:

* ``grouped``: one launch per width present in the layer, the width a
  constexpr, so each instance carries only its own unpack/fit code;
* ``fused``: one launch for all heads, the width read from a per-head table
  and dispatched by a runtime branch (fewer launches, larger kernel).

``fast=True`` divides by the row and column scales through their reciprocals
(one exact division per row/column instead of one per element). Codes then
differ from the reference's on values that fall within an ulp of a rounding
boundary; the tests bound that.
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
def _levels(t, BITS: tl.constexpr):
    """Nearest signed level of ``t`` (see ``reference.quantize_levels``)."""
    if BITS == 2:
        z = tl.where(t < 0, -1.0, 1.0) * tl.where(tl.abs(t) >= 2.0, 3.0, 1.0)
    else:
        QM: tl.constexpr = (1 << (BITS - 1)) - 1
        t = tl.minimum(tl.maximum(t, -QM - 1.0), QM + 1.0)
        z = (t + 12582912.0) - 12582912.0  # + 1.5 * 2**23: round half to even, like torch.round
        z = tl.minimum(tl.maximum(z, -QM * 1.0), QM * 1.0)
    return z


@triton.jit
def _unpack(base, BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Unsigned codes ``[K, V]`` (int32) of the packed head at ``base`` (uint8 pointer)."""
    rows = tl.arange(0, K)[:, None]
    if BITS == 8:
        u = tl.load(base + rows * V + tl.arange(0, V)[None, :]).to(tl.int32)
    elif BITS == 6:
        VW: tl.constexpr = V // 4
        p = base + rows * (3 * VW) + 3 * tl.arange(0, VW)[None, :]
        word = (tl.load(p).to(tl.int32) | (tl.load(p + 1).to(tl.int32) << 8)
                | (tl.load(p + 2).to(tl.int32) << 16))
        sh = (tl.arange(0, 4) * 6)[None, None, :]
        u = tl.reshape((word[:, :, None] >> sh) & 63, (K, V))
    else:
        PER: tl.constexpr = 8 // BITS
        VB: tl.constexpr = V // PER
        byte = tl.load(base + rows * VB + tl.arange(0, VB)[None, :]).to(tl.int32)
        sh = (tl.arange(0, PER) * BITS)[None, None, :]
        u = tl.reshape((byte[:, :, None] >> sh) & ((1 << BITS) - 1), (K, V))
    return u


@triton.jit
def _pack_store(u, base, BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Store unsigned codes ``u [K, V]`` (int32) packed at ``base``."""
    rows = tl.arange(0, K)[:, None]
    if BITS == 8:
        tl.store(base + rows * V + tl.arange(0, V)[None, :], u.to(tl.uint8))
    elif BITS == 6:
        VW: tl.constexpr = V // 4
        sh = (tl.arange(0, 4) * 6)[None, None, :]
        word = tl.sum(tl.reshape(u, (K, VW, 4)) << sh, axis=2)
        p = base + rows * (3 * VW) + 3 * tl.arange(0, VW)[None, :]
        tl.store(p, (word & 255).to(tl.uint8))
        tl.store(p + 1, ((word >> 8) & 255).to(tl.uint8))
        tl.store(p + 2, ((word >> 16) & 255).to(tl.uint8))
    else:
        PER: tl.constexpr = 8 // BITS
        VB: tl.constexpr = V // PER
        sh = (tl.arange(0, PER) * BITS)[None, None, :]
        byte = tl.sum(tl.reshape(u, (K, VB, PER)) << sh, axis=2)
        tl.store(base + rows * VB + tl.arange(0, VB)[None, :], byte.to(tl.uint8))


@triton.jit
def _expand_groups(r, K: tl.constexpr, G: tl.constexpr, V: tl.constexpr):
    """Row factors ``[K, G]`` -> ``[K, V]`` (each over V / G consecutive columns)."""
    return tl.reshape(tl.broadcast_to(r[:, :, None], (K, G, V // G)), (K, V))


@triton.jit
def _head_step(
    rec, rec16, w_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    codes_off, rows_off, cols_off,
    BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, FAST: tl.constexpr,
):
    """The whole step of one head: ``rec``/``rec16`` point at the record (uint8
    / fp16 views), the others at this (request, head)'s inputs and output."""
    rows = tl.arange(0, K)
    cols = tl.arange(0, V)
    kk = tl.load(k_ptr + rows).to(tl.float32)
    qq = tl.load(q_ptr + rows).to(tl.float32)
    vv = tl.load(v_ptr + cols).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr).to(tl.float32))
    beta = tl.load(beta_ptr).to(tl.float32)

    # Reconstruct the decayed state S = exp(g) * r c z (or the fp16 pivot).
    if BITS == 16:
        x_hat = tl.load(rec16 + codes_off // 2 + rows[:, None] * V + cols[None, :]).to(tl.float32)
    else:
        u = _unpack(rec + codes_off, BITS, K, V)
        if BITS == 2:
            z = 2.0 * u.to(tl.float32) - 3.0
            G: tl.constexpr = V // 32
            r = tl.load(rec16 + rows_off // 2 + rows[:, None] * G + tl.arange(0, G)[None, :]).to(tl.float32)
            r_full = _expand_groups(r, K, G, V)
        else:
            z = (u - ((1 << (BITS - 1)) - 1)).to(tl.float32)
            r_full = tl.load(rec16 + rows_off // 2 + rows).to(tl.float32)[:, None]
        c = tl.load(rec16 + cols_off // 2 + cols).to(tl.float32)
        x_hat = (r_full * c[None, :]) * z
    s = decay * x_hat

    # Gated delta rule and the readout from the unquantized X.
    resid = vv - tl.sum(s * kk[:, None], axis=0)
    x = s + kk[:, None] * (beta * resid)[None, :]
    tl.store(out_ptr + cols, tl.sum(x * qq[:, None], axis=0))

    if BITS == 16:
        tl.store(rec16 + codes_off // 2 + rows[:, None] * V + cols[None, :], x.to(tl.float16))
    else:
        QM: tl.constexpr = 3 if BITS == 2 else (1 << (BITS - 1)) - 1
        w = tl.load(w_ptr + rows)
        # 1. row factors from mean |X| and the impact
        if BITS == 2:
            G2: tl.constexpr = V // 32
            mag = tl.sum(tl.reshape(tl.abs(x), (K, G2, 32)), axis=2) * (1.0 / 32)
            mag = tl.maximum(mag, 1e-20)
            r = _fp16_round(tl.sqrt_rn(tl.math.div_rn(mag, w[:, None])))
            r_full = _expand_groups(r, K, G2, V)
        else:
            mag = tl.maximum(tl.sum(tl.abs(x), axis=1) * (1.0 / V), 1e-20)
            r = _fp16_round(tl.sqrt_rn(tl.math.div_rn(mag, w)))
            r_full = r[:, None]
        if FAST:
            y = x * tl.math.div_rn(1.0, r_full)
        else:
            y = tl.math.div_rn(x, r_full)
        # 2. column scales by absmax
        c0 = _fp16_round(tl.math.div_rn(tl.max(tl.abs(y), axis=0), QM * 1.0))
        if FAST:
            z0 = _levels(y * tl.math.div_rn(1.0, c0)[None, :], BITS)
        else:
            z0 = _levels(tl.math.div_rn(y, c0[None, :]), BITS)
        # 3. one w²-weighted least-squares refit, then the final codes
        vals = r_full * z0
        w2 = (w * w)[:, None]
        num = tl.sum(w2 * vals * x, axis=0)
        den = tl.sum(w2 * vals * vals, axis=0)
        c = tl.where(den > 0, _fp16_round(tl.math.div_rn(num, tl.maximum(den, 1e-30))), c0)
        if FAST:
            z = _levels(y * tl.math.div_rn(1.0, c)[None, :], BITS)
        else:
            z = _levels(tl.math.div_rn(y, c[None, :]), BITS)
        if BITS == 2:
            u = ((z + 3.0) * 0.5).to(tl.int32)
            tl.store(rec16 + rows_off // 2 + rows[:, None] * G2 + tl.arange(0, G2)[None, :], r.to(tl.float16))
        else:
            u = (z + QM).to(tl.int32)
            tl.store(rec16 + rows_off // 2 + rows, r.to(tl.float16))
        tl.store(rec16 + cols_off // 2 + cols, c.to(tl.float16))
        _pack_store(u, rec + codes_off, BITS, K, V)


@triton.jit
def _step_kernel(
    pool, pool16, idx_ptr, size, min_slot,
    heads_ptr, bits_ptr, codes_ptr, rows_ptr, cols_ptr,
    w_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    sqn, sqh, skn, skh, svn, svh, sgn, sgh, sbn, sbh,
    H, QK_GROUP,
    BITS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, FAST: tl.constexpr,
):
    """Program (j, n): head ``heads[j]`` of request n. ``BITS=0``: the width is
    read from ``bits[j]`` (fused launch); otherwise it is the constexpr."""
    j = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    h = tl.load(heads_ptr + j)
    out = out_ptr + (n * H + h) * V
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot < min_slot:
        tl.store(out + tl.arange(0, V), tl.zeros((V,), tl.float32))
    else:
        base = slot * size
        rec = pool + base
        rec16 = pool16 + base // 2
        qp = q_ptr + n * sqn + (h // QK_GROUP) * sqh
        kp = k_ptr + n * skn + (h // QK_GROUP) * skh
        vp = v_ptr + n * svn + h * svh
        gp = g_ptr + n * sgn + h * sgh
        bp = beta_ptr + n * sbn + h * sbh
        wp = w_ptr + h * K
        co = tl.load(codes_ptr + j)
        ro = tl.load(rows_ptr + j)
        cl = tl.load(cols_ptr + j)
        if BITS != 0:
            _head_step(rec, rec16, wp, qp, kp, vp, gp, bp, out, co, ro, cl, BITS, K, V, FAST)
        else:
            b = tl.load(bits_ptr + j)
            if b == 16:
                _head_step(rec, rec16, wp, qp, kp, vp, gp, bp, out, co, ro, cl, 16, K, V, FAST)
            elif b == 8:
                _head_step(rec, rec16, wp, qp, kp, vp, gp, bp, out, co, ro, cl, 8, K, V, FAST)
            elif b == 6:
                _head_step(rec, rec16, wp, qp, kp, vp, gp, bp, out, co, ro, cl, 6, K, V, FAST)
            elif b == 4:
                _head_step(rec, rec16, wp, qp, kp, vp, gp, bp, out, co, ro, cl, 4, K, V, FAST)
            else:
                _head_step(rec, rec16, wp, qp, kp, vp, gp, bp, out, co, ro, cl, 2, K, V, FAST)


LAST_KERNELS: list = []  # (width, compiled kernel) of the last step_ call: registers and spills for the benchmark


@dataclass
class _Group:
    bits: int  # 0: mixed (fused launch)
    heads: torch.Tensor
    widths: torch.Tensor
    codes: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


class StepPlan:
    """Device-side head tables of one layer's layout, built once (not per step)."""

    def __init__(self, layout: StateLayout, impact: torch.Tensor, device: torch.device | str):
        k, v = layout.k_dim, layout.v_dim
        if k & (k - 1) or v & (v - 1) or v < INT2_GROUP:
            raise ValueError(f"the Triton step needs power-of-two K and V >= {INT2_GROUP}, got K={k} V={v}")
        if layout.size % 2:
            raise ValueError("the Triton step needs an even record size (fp16 view of the pool)")
        self.layout = layout
        self.impact = impact.to(device=device, dtype=torch.float32).contiguous()
        slots = layout.heads

        def group(bits: int, ids: list[int]) -> _Group:
            col = lambda f: torch.tensor([f(i) for i in ids], dtype=torch.int32, device=device)  # noqa: E731
            return _Group(bits, col(lambda i: i), col(lambda i: slots[i].bits), col(lambda i: slots[i].codes),
                          col(lambda i: slots[i].rows), col(lambda i: slots[i].cols))

        # widest first: the pivot and 8-bit programs are the longest, start them early
        order = sorted(set(layout.bits), reverse=True)
        self.groups = [group(b, [i for i, x in enumerate(layout.bits) if x == b]) for b in order]
        self.fused = group(0, sorted(range(len(layout.bits)), key=lambda i: -layout.bits[i]))


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
    launch: str = "grouped",
    fast: bool = False,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Decode one token per request on the packed pool ``[slots, size]``, in place.

    ``q, k [N, H or H_k, K]`` (key heads are shared by ``H / H_k`` consecutive
    value heads), ``v [N, H, V]``, ``g, beta [N, H]``. Returns ``out [N, H, V]``
    fp32 (or writes the given ``out``, contiguous).
    """
    lay = plan.layout
    n, h = v.shape[0], len(lay.bits)
    kd, vd = lay.k_dim, lay.v_dim
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != lay.size or not pool.is_contiguous():
        raise ValueError(f"pool must be contiguous uint8 [slots, {lay.size}], got {tuple(pool.shape)} {pool.dtype}")
    if q.shape[1] != k.shape[1] or h % q.shape[1]:
        raise ValueError(f"q/k heads {q.shape[1]}/{k.shape[1]} must divide the {h} value heads")
    if out is None:
        out = torch.empty(n, h, vd, dtype=torch.float32, device=v.device)
    if n == 0:
        return out
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dimension")
    nw = num_warps or (8 if kd * vd >= 8192 else 4)
    common = (state_indices, lay.size, min_slot)
    tail = (plan.impact, q, k, v, g, beta, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), h, h // q.shape[1])
    groups = plan.groups if launch == "grouped" else [plan.fused]
    if launch not in ("grouped", "fused"):
        raise ValueError(f"launch must be 'grouped' or 'fused', got {launch!r}")
    LAST_KERNELS.clear()
    for grp in groups:
        kern = _step_kernel[(grp.heads.numel(), n)](
            pool, pool.view(torch.float16), *common, grp.heads, grp.widths, grp.codes, grp.rows, grp.cols, *tail,
            BITS=grp.bits, K=kd, V=vd, FAST=fast, num_warps=nw)
        LAST_KERNELS.append((grp.bits, kern))
    return out


def step(records, layout, impact, q, k, v, g, beta, plan: StepPlan | None = None, **kw):
    """Out-of-place twin of :func:`reference.step` on gathered records ``[N, size]``."""
    plan = plan or StepPlan(layout, impact, records.device)
    new = records.clone()
    idx = torch.arange(records.shape[0], dtype=torch.int32, device=records.device)
    out = step_(new, idx, plan, q, k, v, g, beta, min_slot=0, **kw)
    return out, new


__all__ = ["StepPlan", "step_", "step", "PIVOT"]
