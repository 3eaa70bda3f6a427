"""``vllm-kvq calibrate MODEL --stepquant``: checkpoint + text → STEPQuant state plan."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vllm_kvq.artifacts import model_fingerprint
from vllm_kvq.artifacts.fingerprint import gdn_geometry
from vllm_kvq.calib.calibrate import read_text, token_windows
from vllm_kvq.calib.stepquant.allocate import GAMMA, HORIZON, PIVOT_FRACTION
from vllm_kvq.calib.stepquant.capture import load_model, run_windows
from vllm_kvq.calib.stepquant.plan import fit_plan
from vllm_kvq.calib.stepquant.stats import RESERVOIR, SEED, SNAPSHOT_EVERY, StateStatsCollector
from vllm_kvq.kernels.stepquant.format import BUDGETS

TOKENS = 16384  # 8 windows of 2048
SEQ_LEN = 2048


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
    net = load_model(model, device, getattr(torch, dtype))
    run_windows(net, windows, collector, device)
    t_stats = time.time() - t0
    provenance = {
        "model": str(model), "data": str(data), "tokens": sum(map(len, windows)), "seq_len": seq_len,
        "windows": len(windows), "device": device, "dtype": dtype, "snapshot_every": SNAPSHOT_EVERY,
        "snapshots": snapshots, "seed": SEED, "statistics_seconds": round(t_stats, 1),
    }
    plan = fit_plan(collector.layers, model_fingerprint(config), geometry, budgets=budgets, horizon=horizon,
                    gamma=gamma, pivot_fraction=pivot_fraction, provenance=provenance)
    plan.provenance["seconds"] = round(time.time() - t0, 1)
    return plan.save(out)
