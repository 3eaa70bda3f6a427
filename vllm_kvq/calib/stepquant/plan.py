"""From GDN statistics to a StepQuantPlan (both nominal budgets from one pass)."""

from __future__ import annotations

import torch

from vllm_kvq.artifacts.stepquant import DISTORTION_WIDTHS, StepQuantPlan
from vllm_kvq.calib.stepquant.allocate import (CANDIDATES, GAMMA, HORIZON, PIVOT_FRACTION, allocate_layer,
                                               impact_factors, lifetime_weight, pivot_count)
from vllm_kvq.calib.stepquant.distortion import distortions
from vllm_kvq.calib.stepquant.stats import LayerStats
from vllm_kvq.kernels.stepquant.format import BUDGETS


def fit_plan(stats: dict[int, LayerStats], fingerprint: dict, geometry: dict, *, budgets=BUDGETS,
             horizon: int = HORIZON, gamma: float = GAMMA, pivot_fraction: float = PIVOT_FRACTION,
             provenance: dict | None = None) -> StepQuantPlan:
    """Per layer: w from ω, L from ℓ, d from the codec on the snapshots, then the DP per budget."""
    hv, k = geometry["num_v_heads"], geometry["k_dim"]
    layers = sorted(stats)
    if layers != sorted(geometry["layers"]):
        raise ValueError(f"statistics cover layers {layers}, the model's GDN layers are {geometry['layers']}")
    pivots = pivot_count(hv, pivot_fraction)
    bits = {b: {} for b in budgets}
    impacts, log_decay, omega, dist = {}, {}, {}, {}
    for layer in layers:
        st = stats[layer]
        if not st.snapshots.items:
            raise ValueError(f"layer {layer} has no state snapshots; calibrate on more tokens")
        w = impact_factors(st.omega, gamma)
        life = lifetime_weight(st.log_decay, horizon)
        d = distortions(st.states(), w.float(), DISTORTION_WIDTHS)  # [HV, 4] fp64
        for b in budgets:
            widths = CANDIDATES[b]
            cols = [DISTORTION_WIDTHS.index(x) for x in widths]
            cost = (life.unsqueeze(-1) * d[:, cols]).numpy()
            bits[b][layer] = tuple(allocate_layer(cost, widths, b, pivots).bits)
        impacts[layer] = w.float()
        log_decay[layer], omega[layer], dist[layer] = st.log_decay, st.omega, d
    return StepQuantPlan(
        fingerprint=fingerprint, layers=layers, num_v_heads=hv, k_dim=k, v_dim=geometry["v_dim"],
        budgets=list(budgets), bits=bits, impacts=impacts, log_decay=log_decay, omega=omega, distortion=dist,
        num_k_heads=geometry.get("num_k_heads"),
        settings={"horizon": horizon, "gamma": gamma, "pivot_fraction": pivot_fraction, "pivots_per_layer": pivots,
                  "candidates": {str(b): list(CANDIDATES[b]) for b in budgets}, "pivot_budget_bits": 8},
        provenance=dict(provenance or {}),
    )

