"""Bit allocation for one GDN layer: lifetime weights, impact factors, pivots
and an exact multiple-choice knapsack.

Costs are ``L_h · d_h(b)``: the gate-only lifetime of an error in head h times
its codec distortion at width b. vLLM gives every GDN layer's state page one
size, so each layer gets the same budget ``b̄·HV − 8·P`` (a pivot counts as
8 bits, as in the paper) and is solved on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvq.kernels.stepquant.format import PIVOT, PIVOT_BUDGET_BITS

CANDIDATES = {6: (4, 6, 8), 4: (2, 4, 6, 8)}
GAMMA = 0.25
HORIZON = 2048
PIVOT_FRACTION = 32 / 2304  # the paper's 32 of 2,304 Qwen heads
OMEGA_FLOOR = 1e-20


def lifetime_weight(log_decay: torch.Tensor, horizon: int = HORIZON) -> torch.Tensor:
    """L = Σ_{j<H} exp(2jℓ) = expm1(2Hℓ)/expm1(2ℓ), exactly H at ℓ = 0 (fp64)."""
    ell = log_decay.double()
    if not torch.isfinite(ell[~torch.isneginf(ell)]).all() or (ell > 0).any():
        raise ValueError(f"mean log decay must be <= 0 and not NaN, got {ell.tolist()}")
    safe = torch.where(ell == 0, -1.0, 2.0 * ell)
    return torch.where(ell == 0, float(horizon), torch.expm1(horizon * safe) / torch.expm1(safe))


def impact_factors(omega: torch.Tensor, gamma: float = GAMMA) -> torch.Tensor:
    """w = ω^(γ/2), normalised to geometric mean 1 over each head's key rows (fp64)."""
    log_w = 0.5 * gamma * torch.log(omega.double().clamp_min(OMEGA_FLOOR))
    return torch.exp(log_w - log_w.mean(-1, keepdim=True))


def pivot_count(num_heads: int, fraction: float) -> int:
    """Pivots per layer: fraction·HV rounded half up (the same in every layer)."""
    return int(math.floor(fraction * num_heads + 0.5))


def knapsack(cost: np.ndarray, widths: tuple[int, ...], budget: int) -> tuple[list[int], float]:
    """Exact multiple-choice knapsack: one width per unit, Σ widths ≤ budget, min Σ cost.

    ``cost`` ``[n, len(widths)]``. Dynamic programming over integer bits with
    backtracking; O(n · budget · |widths|). Ties keep the narrower width.
    """
    n = cost.shape[0]
    if min(widths) * n > budget:
        raise ValueError(f"budget {budget} bits cannot hold {n} units of at least {min(widths)} bits")
    inf = float("inf")
    best = np.zeros(budget + 1)  # best[j]: min cost of the units so far within j bits
    choice = np.zeros((n, budget + 1), dtype=np.int64)
    for u in range(n):
        new = np.full(budget + 1, inf)
        pick = np.zeros(budget + 1, dtype=np.int64)
        for c, b in enumerate(widths):
            if b > budget:
                continue
            cand = np.full(budget + 1, inf)
            cand[b:] = best[: budget + 1 - b] + cost[u, c]
            better = cand < new
            new[better], pick[better] = cand[better], c
        best, choice[u] = new, pick
    out, j = [0] * n, budget
    for u in range(n - 1, -1, -1):
        c = int(choice[u, j])
        out[u] = widths[c]
        j -= widths[c]
    return out, float(best[budget])


@dataclass
class LayerPlan:
    bits: list[int]  # per value head; 16 = FP16 pivot
    pivots: list[int]
    cost: float  # Σ L·d over integer heads


def allocate_layer(cost: np.ndarray, widths: tuple[int, ...], nominal: int, pivots: int) -> LayerPlan:
    """The paper's rule inside one layer: DP without pivots, the ``pivots`` heads of
    highest residual risk L·d(b_init) become FP16, DP again on the rest with
    ``nominal·HV − 8·pivots`` bits."""
    hv = cost.shape[0]
    if not 0 <= pivots < hv:
        raise ValueError(f"pivots per layer must be in [0, {hv}), got {pivots}")
    chosen: list[int] = []
    if pivots:
        init, _ = knapsack(cost, widths, nominal * hv)
        risk = [cost[h, widths.index(b)] for h, b in enumerate(init)]
        chosen = sorted(sorted(range(hv), key=lambda h: (-risk[h], h))[:pivots])
    rest = [h for h in range(hv) if h not in chosen]
    sub, total = knapsack(cost[rest], widths, nominal * hv - PIVOT_BUDGET_BITS * pivots)
    bits = [PIVOT] * hv
    for h, b in zip(rest, sub):
        bits[h] = b
    return LayerPlan(bits, chosen, total)
