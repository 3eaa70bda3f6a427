"""Plain PyTorch STEPQuant state codec: the CPU path inside vLLM, the codec
calibration scores candidate widths with, and the ground truth that the Triton
kernels are compared against.

States are fp32 ``[N, H, K, V]`` in math orientation (key rows, value
columns); records are uint8 ``[N, layout.size]`` (see ``format.py``). The fit
(``stepquant``: impact-weighted row factors, absmax column scales, one
w²-weighted refit; ``rowwise``: one absmax scale per key row) is
docs/stepquant.md's "What is stored". :func:`foreground` and
:func:`writeback` are the twins of the split Triton step.

Being the CPU serving path, the code minds its passes over memory (slices of
requests that stay in cache, one scratch, views of consecutive heads), each
computing the same floating-point operations, so the records are bit for bit
what the plain formulas give (``tests/kernels/test_stepquant_reference.py``).
"""

from __future__ import annotations

import torch

from vllm_kvq.kernels.stepquant.format import FITS, INT2_GROUP, PIVOT, StateLayout

FP16_MIN = 2.0**-24
FP16_MAX = 65504.0
L2_EPS = 1e-6


def normalize_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys as the GDN kernels take them: each row ``x / sqrt(sum
    x^2 + eps)``, the queries then scaled by ``K^-1/2``."""
    q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k




def fp16_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the fp16 value that will be stored (positive scales only)."""
    return x.clamp(FP16_MIN, FP16_MAX).half().float()


def qmax(bits: int) -> int:
    return 3 if bits == 2 else 2 ** (bits - 1) - 1


def quantize_levels(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Nearest signed level: integers in [-qmax, qmax], or {-3,-1,1,3} for INT2."""
    if bits == 2:
        return torch.where(y < 0, -1.0, 1.0) * torch.where(y.abs() >= 2.0, 3.0, 1.0)
    q = qmax(bits)
    return torch.round(y).clamp(-q, q)


def _levels_into(y: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`quantize_levels` in place (the same values; no new tensor)."""
    if bits == 2:
        sign = torch.where(y < 0, -1.0, 1.0)
        return y.abs_().ge_(2.0).mul_(2.0).add_(1.0).mul_(sign)
    q = qmax(bits)
    return y.round_().clamp_(-q, q)


def fit_heads(x: torch.Tensor, impact: torch.Tensor, bits: int, fit: str = "stepquant",
              row_stat: torch.Tensor | None = None):
    """Fit one width's heads. ``x`` [N, h, K, V] fp32, ``impact`` [h, K].

    ``row_stat`` [N, h, K, n_r]: each row's mean |X| (``stepquant``; per
    32-column group for INT2) or max |X| (``rowwise``) when it is already
    known (the split step's foreground sums it while it has X), else taken
    from ``x``. Returns (codes z as float [N, h, K, V], row scales [N, h, K,
    n_r], column scales [N, h, V]), the scales already fp16-rounded.
    """
    n, h, k, v = x.shape
    q = float(qmax(bits))
    if fit == "rowwise":
        peak = x.abs().amax(-1, keepdim=True) if row_stat is None else row_stat
        r = fp16_round(peak / q)
        c = torch.ones(n, h, v, dtype=torch.float32, device=x.device)
        return _levels_into(x / r, bits), r, c
    if fit != "stepquant":
        raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
    groups = v // INT2_GROUP if bits == 2 else 1
    xg = x.view(n, h, k, groups, v // groups)  # row factors per value group
    w = impact.float().view(1, h, k, 1, 1)
    big = torch.empty_like(xg)  # one scratch for the element-wise temporaries
    mag = torch.abs(xg, out=big).mean(-1, keepdim=True) if row_stat is None else row_stat.view(n, h, k, groups, 1)
    r = fp16_round(torch.sqrt(mag.clamp_min(1e-20) / w))
    y = xg / r
    c = fp16_round(torch.abs(y, out=big).amax(2, keepdim=True) / q)  # [N, h, 1, G, V/G]
    vals = _levels_into(torch.div(y, c, out=big), bits).mul_(r)  # z * r
    wv = vals.mul(w * w)
    num = wv.mul(xg).sum(2, keepdim=True)
    den = wv.mul_(vals).sum(2, keepdim=True)
    c = torch.where(den > 0, fp16_round(num / den.clamp_min(1e-30)), c)
    z = _levels_into(torch.div(y, c, out=big), bits)
    return z.view(n, h, k, v), r.view(n, h, k, groups), c.view(n, h, v)


def _row_stat(parts: torch.Tensor, bits: int, v: int, fit: str) -> torch.Tensor:
    """The row statistic :func:`fit_heads` takes, ``[N, h, K, n_r]``, from the
    foreground's row partials ``[N, h, V/P, K]`` (sum or max of |X| over each
    P value columns; P = 32 where INT2 heads need one per column group)."""
    if fit == "rowwise":
        return parts.amax(2).unsqueeze(-1)
    if bits == 2:
        return parts.transpose(-1, -2) / INT2_GROUP
    return (parts.sum(2) / v).unsqueeze(-1)


# ---------------------------------------------------------------------------
# Bit packing (row-major over [K, V], little-endian)
# ---------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [..., K, V] (int) -> packed uint8 [..., K*V*bits/8]."""
    flat = codes.reshape(*codes.shape[:-2], -1).to(torch.int32)
    if bits == 8:
        return flat.to(torch.uint8)
    if bits in (2, 4):
        per = 8 // bits
        g = flat.view(*flat.shape[:-1], -1, per)
        word = torch.zeros_like(g[..., 0])
        for s in range(per):
            word |= g[..., s] << (bits * s)
        return word.to(torch.uint8)
    g = flat.view(*flat.shape[:-1], -1, 4)  # 6 bits: 4 codes -> 3 bytes
    word = g[..., 0] | (g[..., 1] << 6) | (g[..., 2] << 12) | (g[..., 3] << 18)
    out = torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], dim=-1)
    return out.reshape(*flat.shape[:-1], -1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, k: int, v: int) -> torch.Tensor:
    """Packed uint8 [..., K*V*bits/8] -> unsigned codes int32 [..., K, V]."""
    p = packed.to(torch.int32)
    lead = p.shape[:-1]
    if bits == 8:
        return p.view(*lead, k, v)
    if bits in (2, 4):
        shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=p.device)
        return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*lead, k, v)
    g = p.view(*lead, -1, 3)
    word = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
    shifts = torch.arange(0, 24, 6, dtype=torch.int32, device=p.device)
    return ((word.unsqueeze(-1) >> shifts) & 63).reshape(*lead, k, v)


def _to_unsigned(z: torch.Tensor, bits: int) -> torch.Tensor:
    return ((z + 3) / 2 if bits == 2 else z + qmax(bits)).to(torch.int32)


def _to_signed(u: torch.Tensor, bits: int) -> torch.Tensor:
    return (2.0 * u - 3.0) if bits == 2 else u.float() - qmax(bits)


# ---------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    return x.contiguous().view(torch.uint8).reshape(n, -1)


CPU_SLICE_BYTES = 2 << 20


def _request_slices(n: int, bytes_per_request: int, device: torch.device):
    """On CPU, slices of requests whose fit temporaries stay in cache (the fit
    is per request, so the records do not depend on the slicing; 2-3x faster
    than whole-batch passes over memory). Elsewhere, one slice."""
    step = n if device.type != "cpu" else max(1, CPU_SLICE_BYTES // bytes_per_request)
    return [slice(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _heads(x: torch.Tensor, rq: slice, idx: list[int]) -> torch.Tensor:
    """``x[rq, idx]``, a view (no copy) when the heads are consecutive and
    each head is row-major."""
    if idx == list(range(idx[0], idx[-1] + 1)) and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x[rq, idx[0] : idx[-1] + 1]
    return x[rq, idx]


def encode(x: torch.Tensor, layout: StateLayout, impact: torch.Tensor, fit: str = "stepquant",
           parts: torch.Tensor | None = None) -> torch.Tensor:
    """Fit and pack states ``[N, H, K, V]`` into records ``[N, layout.size]``;
    with ``parts`` (see :func:`foreground`) the row factors come from them."""
    n, h, k, v = x.shape
    assert (h, k, v) == (len(layout.bits), layout.k_dim, layout.v_dim), (x.shape, layout)
    if parts is not None and 2 in layout.bits and parts.shape[2] != v // INT2_GROUP:
        raise ValueError(f"INT2 heads need row partials per {INT2_GROUP} columns, got {parts.shape[2]} per row")
    x = x.float()
    out = torch.empty(n, layout.size, dtype=torch.uint8, device=x.device)
    out[:, layout.heads_bytes :] = 0  # heads fill [0, heads_bytes) back to back; no updates held
    if layout.tail:  # no update held, d = 1
        h, t = len(layout.bits), layout.tail
        zeros = torch.zeros(n, h, t, device=x.device)
        out[:, layout.tail_offset : layout.packed_bytes] = _tail_bytes(
            torch.zeros(n, dtype=torch.int32, device=x.device), torch.ones(n, h, device=x.device), zeros,
            zeros[..., None].expand(n, h, t, v), zeros[..., None].expand(n, h, t, k), layout)
    slots = layout.heads
    for bits in sorted(set(layout.bits)):
        idx = [i for i, b in enumerate(layout.bits) if b == bits]
        for rq in _request_slices(n, 4 * len(idx) * k * v, x.device):
            xs, dst = _heads(x, rq, idx), out[rq]
            if bits == PIVOT:
                blob = xs.half()
                for j, i in enumerate(idx):
                    s = slots[i]
                    dst[:, s.codes : s.codes + s.codes_bytes] = _fp16_bytes(blob[:, j])
                continue
            stat = None if parts is None else _row_stat(_heads(parts, rq, idx), bits, v, fit)
            z, r, c = fit_heads(xs, impact[idx], bits, fit, stat)
            packed = pack_codes(_to_unsigned(z, bits), bits)
            r16, c16 = r.half(), c.half()
            for j, i in enumerate(idx):
                s = slots[i]
                dst[:, s.codes : s.codes + s.codes_bytes] = packed[:, j]
                dst[:, s.rows : s.rows + 2 * k * s.row_groups] = _fp16_bytes(r16[:, j])
                dst[:, s.cols : s.cols + 2 * v] = _fp16_bytes(c16[:, j])
    return out


def decode(records: torch.Tensor, layout: StateLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack records ``[N, size]`` into fp32 states ``[N, H, K, V]``, held
    updates included (into ``out`` when given: fp32, row-major heads)."""
    n = records.shape[0]
    k, v = layout.k_dim, layout.v_dim
    if out is None:
        out = torch.empty(n, len(layout.bits), k, v, dtype=torch.float32, device=records.device)
    _decode_heads(records, layout, out)
    if layout.tail:
        held, d, w, u, keys = _tail_views(records, layout)
        live = torch.arange(layout.tail, device=records.device) < held[:, None, None]  # [N, 1, t]
        out.mul_(d[..., None, None]).add_(torch.einsum("nhe,nhek,nhev->nhkv", torch.where(live, w, 0.0),
                                                      keys.float(), u.float()))
    return out


def _tail_views(records: torch.Tensor, layout: StateLayout):
    """The held updates of records ``[N, size]`` (format.py), as views of a
    copy: (n [N] int32, d [N, H], w [N, H, t], u [N, H, t, V] fp16, k [N, H,
    t, K] fp16). :func:`_tail_bytes` packs them back."""
    n, h, t = records.shape[0], len(layout.bits), layout.tail
    at = layout.tail_offset
    raw = records[:, at : layout.packed_bytes].contiguous()
    held = raw[:, :4].view(torch.int32).view(n)
    heads = raw[:, 16:].view(n, h, layout.tail_head_bytes)
    sc = heads[..., : layout.tail_scalar_bytes].view(torch.float32)
    uk = heads[..., layout.tail_scalar_bytes :].view(torch.float16)
    u = uk[..., : t * layout.v_dim].unflatten(-1, (t, layout.v_dim))
    return held, sc[..., 0], sc[..., 1 : 1 + t], u, uk[..., t * layout.v_dim :].unflatten(-1, (t, layout.k_dim))


def _tail_bytes(held, d, w, u, k, layout: StateLayout) -> torch.Tensor:
    """The bytes ``[N, packed_bytes - tail_offset]`` of :func:`_tail_views`' fields."""
    n, h = held.shape[0], len(layout.bits)
    out = torch.zeros(n, layout.packed_bytes - layout.tail_offset, dtype=torch.uint8, device=held.device)
    out[:, :4] = held.to(torch.int32).view(n, 1).view(torch.uint8)
    heads = out[:, 16:].view(n, h, layout.tail_head_bytes)
    sc = torch.cat((d.float()[..., None], w.float()), -1).contiguous().view(torch.uint8)
    heads[..., : sc.shape[-1]] = sc
    heads[..., layout.tail_scalar_bytes :] = torch.cat((u.half().flatten(-2), k.half().flatten(-2)), -1).contiguous().view(torch.uint8)
    return out


def _decode_heads(records: torch.Tensor, layout: StateLayout, out: torch.Tensor) -> None:
    """X̂ of every head (the codes and scales alone) into ``out``."""
    n = records.shape[0]
    k, v = layout.k_dim, layout.v_dim
    for i, s in enumerate(layout.heads):
        raw = records[:, s.codes : s.codes + s.codes_bytes]
        if s.bits == PIVOT:
            out[:, i] = raw.contiguous().view(torch.float16).view(n, k, v).float()
            continue
        z = _to_signed(unpack_codes(raw, s.bits, k, v), s.bits)
        g = s.row_groups
        r = records[:, s.rows : s.rows + 2 * k * g].contiguous().view(torch.float16).view(n, k, g, 1).float()
        c = records[:, s.cols : s.cols + 2 * v].contiguous().view(torch.float16).view(n, 1, g, v // g).float()
        torch.mul(r * c, z.view(n, k, g, v // g), out=out[:, i].view(n, k, g, v // g))


def roundtrip(x: torch.Tensor, layout: StateLayout, impact: torch.Tensor, fit: str = "stepquant") -> torch.Tensor:
    """``decode(encode(x))``: what the pool will hand back next step."""
    return decode(encode(x, layout, impact, fit), layout)


# ---------------------------------------------------------------------------
# Decode step
# ---------------------------------------------------------------------------


def _update(records, layout, q, k, v, g, beta):
    """The gated delta rule on the decoded records: (X, out, δ)."""
    x_hat = decode(records, layout)
    s = torch.exp(g.float())[..., None, None] * x_hat
    k, q = k.float(), q.float()
    delta = beta.float().unsqueeze(-1) * (v.float() - (s * k.unsqueeze(-1)).sum(-2))
    x = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return x, (x * q.unsqueeze(-1)).sum(-2), delta


def step(
    records: torch.Tensor,
    layout: StateLayout,
    impact: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    fit: str = "stepquant",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated delta-rule token per request on packed states.

    ``records [N, size]``; ``q, k [N, H, K]`` per value head (L2-normed, q
    scaled; GQA callers expand key heads), ``v [N, H, V]``, ``g`` (log-decay)
    and ``beta`` ``[N, H]``. Per head: ``S = exp(g) X̂``, ``X = S + k δᵀ`` with
    ``δ = β (v - Sᵀk)``, ``out = Xᵀq`` from the unquantized X (the paper's
    readout), and ``new_records = commit(X)`` (X fitted, or with held updates
    this one appended until the record is due). Returns (out fp32 [N, H, V],
    new_records).
    """
    x, out, delta = _update(records, layout, q, k, v, g, beta)
    return out, commit(records, layout, impact, x, k, delta, torch.exp(g.float()), fit)


def commit(records, layout, impact, x, k, delta, decay, fit: str = "stepquant", parts=None) -> torch.Tensor:
    """The new records for the updated states ``x`` (``X = decay S_old + k
    δᵀ``): fitted (:func:`encode`, with ``parts`` as there), or, while a
    record holds fewer than ``layout.tail`` updates, the old codes kept and
    this update appended (format.py)."""
    if not layout.tail:
        return encode(x, layout, impact, fit, parts=parts)
    held, d, w, u, keys = _tail_views(records, layout)
    due = held >= layout.tail
    new = records.clone()
    if bool(due.any()):  # fitted: nothing held, d = 1, the stale entries left as they were
        fitted = encode(x[due], layout, impact, fit, parts=None if parts is None else parts[due])
        fitted[:, layout.tail_offset : layout.packed_bytes] = _tail_bytes(
            torch.zeros(int(due.sum()), dtype=torch.int32, device=x.device), torch.ones_like(d[due]), w[due], u[due],
            keys[due], layout)
        new[due] = fitted
    keep = ~due
    if bool(keep.any()):
        rows, e = torch.arange(int(keep.sum()), device=records.device), held[keep].long()
        step_decay = decay[keep].float()
        w, u, kk = w[keep] * step_decay[..., None], u[keep].clone(), keys[keep].clone()
        w[rows, :, e] = 1.0
        u[rows, :, e] = delta[keep].half()
        kk[rows, :, e] = k[keep].half()
        new[keep, layout.tail_offset : layout.packed_bytes] = _tail_bytes(
            held[keep] + 1, d[keep] * step_decay, w, u, kk, layout)
    return new


# ---------------------------------------------------------------------------
# The same step split in two (the twins of the Triton foreground and writeback)
# ---------------------------------------------------------------------------


def foreground(records, layout, q, k, v, g, beta, fit: str = "stepquant", part: int = INT2_GROUP):
    """What the layer waits for: the readout, and the small side products the
    writeback needs. Inputs as :func:`step`. Returns (out [N, H, V], δ [N, H,
    V], row partials [N, H, V/part, K]: sum of |X| over each ``part`` value
    columns, or their max for the rowwise fit). The records are only read."""
    x, out, delta = _update(records, layout, q, k, v, g, beta)
    n, h, kd, vd = x.shape
    ax = x.abs().view(n, h, kd, vd // part, part)
    parts = ax.amax(-1) if fit == "rowwise" else ax.sum(-1)
    return out, delta, parts.transpose(-1, -2).contiguous()


def writeback(records, layout, impact, k, decay, delta, parts, fit: str = "stepquant") -> torch.Tensor:
    """The rest of the step, off the critical path: rebuild ``X = decay X̂ + k
    δᵀ`` from the old record and the rank-1 update (``k [N, H, K]``, ``decay =
    exp(g) [N, H]``), take the row factors from the partials, fit the columns
    and pack. Returns the new records; equal to :func:`step`'s except where
    the partials' summation order moves a row factor across an fp16 rounding
    boundary."""
    x = decay.float()[..., None, None] * decode(records, layout) + k.float().unsqueeze(-1) * delta.unsqueeze(-2)
    return commit(records, layout, impact, x, k, delta, decay, fit, parts)
