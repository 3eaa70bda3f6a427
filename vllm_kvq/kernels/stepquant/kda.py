"""STEPQuant's row-unit codec for KDA (Kimi Delta Attention) states, in plain
PyTorch: the layout, the fit, and the decode step (docs/stepquant.md, "KDA").

KDA decays every key row by its own gate, so a plan gives each key row its own
width; the rows of a head share one fp16 column-scale vector, so a b-bit row
stores ``q`` meaning ``2^(8-b) q`` (common 8-bit steps): a value is ``r_i c_j
2^(8-b_i) q_ij``. Record per head: the rows' codes grouped by width (2, 4, 6,
8, then fp16 pivots; key order within a width; packed as in ``format.py``,
unsigned ``q + qmax``), fp16 row factors ``[K]`` (pivots 0), fp16 column
scales ``[V]``. States are fp32 ``[N, H, K, V]`` in math orientation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from vllm_kvq.kernels.stepquant.format import PIVOT, WIDTHS
from vllm_kvq.kernels.stepquant.reference import fp16_round, pack_codes, unpack_codes


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


@dataclass(frozen=True)
class KdaLayout:
    """Per head, per key row: the row's width (``bits[h][i]``)."""

    bits: tuple[tuple[int, ...], ...]
    k_dim: int
    v_dim: int

    def __post_init__(self) -> None:
        if any(len(row) != self.k_dim for row in self.bits):
            raise ValueError(f"every head needs {self.k_dim} row widths")
        bad = {b for row in self.bits for b in row} - set(WIDTHS) - {PIVOT}
        if bad:
            raise ValueError(f"row widths must be in {WIDTHS} or {PIVOT} (pivot), got {sorted(bad)}")
        if self.v_dim % 4:
            raise ValueError(f"V must be a multiple of 4, got {self.v_dim}")

    @cached_property
    def tables(self) -> tuple[list[list[int]], list[int], list[int], int]:
        """(byte offset of every row's codes [H][K], of every head's row
        factors, of its column scales, the record's size)."""
        rows, scales, cols, at = [], [], [], 0
        for widths in self.bits:
            offsets = [0] * self.k_dim
            for b in (*WIDTHS, PIVOT):
                for i, w in enumerate(widths):
                    if w == b:
                        offsets[i] = at
                        at += self.v_dim * b // 8
            rows.append(offsets)
            scales.append(at)
            cols.append(at + 2 * self.k_dim)
            at += 2 * self.k_dim + 2 * self.v_dim
        return rows, scales, cols, at

    @property
    def size(self) -> int:
        return self.tables[3]

    def bits_per_value(self) -> float:
        return 8 * self.size / (len(self.bits) * self.k_dim * self.v_dim)


def _fp16_view(records: torch.Tensor, at: int, count: int) -> torch.Tensor:
    return records[:, at : at + 2 * count].contiguous().view(torch.float16).float()


def _levels(y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.maximum(torch.minimum(torch.round(y), q), -q)


def fit_head(x: torch.Tensor, widths: tuple[int, ...], impact: torch.Tensor):
    """The fit of one head's states ``x [N, K, V]``: (signed codes q as float
    [N, K, V], row factors [N, K], column scales [N, V]), fp16-rounded; pivot
    rows get code 0 and row factor 0."""
    b = torch.tensor(widths, device=x.device)
    integer = (b != PIVOT).view(1, -1, 1)
    qm = torch.where(b == PIVOT, 0, 2 ** (b - 1) - 1).float().view(1, -1, 1)
    norm = torch.where(b == PIVOT, 1, 2.0 ** (8 - b)).float().view(1, -1, 1)
    w = impact.float().view(1, -1, 1)
    r = torch.where(integer, fp16_round(torch.sqrt(x.abs().mean(-1, keepdim=True).clamp_min(1e-20) / w)), 0.0)
    y = torch.where(integer, x / torch.where(integer, r, 1.0), 0.0)  # X / r on integer rows
    unit = torch.where(integer, qm * norm, 1.0)
    c = fp16_round((y.abs() / unit).amax(1, keepdim=True))  # [N, 1, V]
    q0 = _levels(y / (c * norm), qm)
    v = r * norm * q0
    num = (w * w * v * x).sum(1, keepdim=True)
    den = (w * w * v * v).sum(1, keepdim=True)
    c = torch.where(den > 0, fp16_round(num / den.clamp_min(1e-30)), c)
    q = _levels(y / (c * norm), qm)
    return q, r.squeeze(-1), c.squeeze(1)


def encode(x: torch.Tensor, layout: KdaLayout, impact: torch.Tensor) -> torch.Tensor:
    """Fit and pack states ``[N, H, K, V]`` into records ``[N, layout.size]``."""
    n, h, kd, vd = x.shape
    assert (h, kd, vd) == (len(layout.bits), layout.k_dim, layout.v_dim), (x.shape, layout)
    rows, scales, cols, size = layout.tables
    out = torch.zeros(n, size, dtype=torch.uint8, device=x.device)
    for hd, widths in enumerate(layout.bits):
        xh = x[:, hd].float()
        q, r, c = fit_head(xh, widths, impact[hd])
        for b in set(widths):
            ids = [i for i, w in enumerate(widths) if w == b]
            at = rows[hd][ids[0]]  # a width's rows are consecutive, in key order
            blob = (xh[:, ids].half().contiguous().view(torch.uint8).reshape(n, -1) if b == PIVOT
                    else pack_codes((q[:, ids] + qmax(b)).to(torch.int32), b))
            out[:, at : at + blob.shape[1]] = blob
        out[:, scales[hd] : scales[hd] + 2 * kd] = r.half().contiguous().view(torch.uint8).reshape(n, -1)
        out[:, cols[hd] : cols[hd] + 2 * vd] = c.half().contiguous().view(torch.uint8).reshape(n, -1)
    return out


def decode(records: torch.Tensor, layout: KdaLayout) -> torch.Tensor:
    """Records ``[N, size]`` -> fp32 states ``[N, H, K, V]``."""
    n, kd, vd = records.shape[0], layout.k_dim, layout.v_dim
    rows, scales, cols, _ = layout.tables
    out = torch.empty(n, len(layout.bits), kd, vd, dtype=torch.float32, device=records.device)
    for hd, widths in enumerate(layout.bits):
        r = _fp16_view(records, scales[hd], kd)
        c = _fp16_view(records, cols[hd], vd)
        for b in set(widths):
            ids = [i for i, w in enumerate(widths) if w == b]
            at = rows[hd][ids[0]]
            raw = records[:, at : at + len(ids) * vd * b // 8]
            if b == PIVOT:
                out[:, hd, ids] = raw.contiguous().view(torch.float16).view(n, len(ids), vd).float()
            else:
                q = unpack_codes(raw, b, len(ids), vd).float() - qmax(b)
                out[:, hd, ids] = (r[:, ids, None] * c[:, None, :]) * (2.0 ** (8 - b) * q)
    return out


def step(records, layout: KdaLayout, impact, q, k, v, g, beta):
    """One KDA token per request on packed states: ``q, k [N, H, K]``
    (L2-normed, q scaled by K^-1/2), ``v [N, H, V]``, ``g [N, H, K]``
    (per-channel log-decay), ``beta [N, H]``. Per head: ``S = diag(exp(g))
    X̂``, ``X = S + k δᵀ`` with ``δ = β (v - Sᵀk)``, ``out = Xᵀq`` from the
    unquantized X. Returns (out fp32 [N, H, V], new records)."""
    s = torch.exp(g.float()).unsqueeze(-1) * decode(records, layout)
    k, q = k.float(), q.float()
    delta = beta.float().unsqueeze(-1) * (v.float() - (s * k.unsqueeze(-1)).sum(-2))
    x = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (x * q.unsqueeze(-1)).sum(-2), encode(x, layout, impact)

