"""``vllm-kvq calibrate MODEL --stepquant``: checkpoint + text → STEPQuant
state plan (both nominal budgets from one pass over the text)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vllm_kvq.artifacts import model_fingerprint
from vllm_kvq.artifacts.fingerprint import gdn_geometry
from vllm_kvq.artifacts.stepquant import DISTORTION_WIDTHS, StepQuantPlan
from vllm_kvq.calib.calibrate import read_text, token_windows
from vllm_kvq.calib.capture import load_model
from vllm_kvq.calib.stepquant.allocate import (CANDIDATES, GAMMA, HORIZON, PIVOT_FRACTION, allocate_layer,
                                               impact_factors, lifetime_weight, pivot_count)
from vllm_kvq.calib.stepquant.capture import run_windows
from vllm_kvq.calib.stepquant.stats import RESERVOIR, SEED, SNAPSHOT_EVERY, LayerStats, StateStatsCollector
from vllm_kvq.calib import single_thread
from vllm_kvq.kernels.stepquant import reference
from vllm_kvq.kernels.stepquant.format import BUDGETS, StateLayout

TOKENS = 16384  # 8 windows of 2048
SEQ_LEN = 2048
CHUNK = 4  # snapshots per codec call (bounds temporary memory)


def calibrate_stepquant(model: str, data: str, out: str, *, tokens: int = TOKENS, seq_len: int = SEQ_LEN,
                        pivot_fraction: float = PIVOT_FRACTION, horizon: int = HORIZON, gamma: float = GAMMA,
                        budgets=BUDGETS, snapshots: int = RESERVOIR, device: str = "cpu", dtype: str = "float32",
                        tokenizer: str | None = None) -> Path:
    from transformers import AutoConfig, AutoTokenizer

    t0 = time.time()
    config = AutoConfig.from_pretrained(model)
    geometry = gdn_geometry(config)
    tok = AutoTokenizer.from_pretrained(tokenizer or model)
    windows = token_windows(tok, read_text(data), tokens, seq_len)
    if len(windows[-1]) < seq_len:
        raise ValueError(f"{data} is shorter than one window of {seq_len} tokens")
    collector = StateStatsCollector(SNAPSHOT_EVERY, snapshots, SEED)
    run_windows(load_model(model, device, getattr(torch, dtype)), windows, collector, device)
    provenance = {
        "model": str(model), "data": str(data), "tokens": sum(map(len, windows)), "seq_len": seq_len,
        "windows": len(windows), "device": device, "dtype": dtype, "snapshot_every": SNAPSHOT_EVERY,
        "snapshots": snapshots, "seed": SEED, "statistics_seconds": round(time.time() - t0, 1),
    }
    plan = fit_plan(collector.layers, model_fingerprint(config), geometry, budgets=budgets, horizon=horizon,
                    gamma=gamma, pivot_fraction=pivot_fraction, provenance=provenance)
    plan.provenance["seconds"] = round(time.time() - t0, 1)
    return plan.save(out)


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
            cost = (life.unsqueeze(-1) * d[:, [DISTORTION_WIDTHS.index(x) for x in CANDIDATES[b]]]).numpy()
            bits[b][layer] = tuple(allocate_layer(cost, CANDIDATES[b], b, pivots).bits)
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


def distortions(states: torch.Tensor, impact: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """Candidate distortions from the serving codec itself: ``states`` ``[N,
    HV, K, V]`` fp32, ``impact`` w ``[HV, K]`` → d ``[HV, len(widths)]`` fp64,
    d_h(b) the mean over snapshots and elements of w_i² (Ŝ − S)², where Ŝ is
    what the pool hands back with every head at width b. Heads have their own
    scales, so a uniform-width record scores each head exactly as it would
    sit in a mixed one."""
    n, hv, k, v = states.shape
    w2 = impact.double().square().view(1, hv, k, 1)
    out = torch.zeros(hv, len(widths), dtype=torch.float64)
    with single_thread():
        for c, b in enumerate(widths):
            layout = StateLayout((b,) * hv, k, v)
            for i in range(0, n, CHUNK):
                x = states[i : i + CHUNK].float()
                err = (reference.roundtrip(x, layout, impact.float()) - x).double()
                out[:, c] += (w2 * err.square()).sum((0, 2, 3))
    return out / (n * k * v)
