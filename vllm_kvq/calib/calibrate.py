"""``vllm-kvq calibrate``: a checkpoint plus calibration text → an artifact."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import torch

from vllm_kvq.artifacts import model_fingerprint
from vllm_kvq.artifacts.schema import ArtifactError, Tiers, check_tiers
from vllm_kvq.artifacts.fingerprint import head_dim, text_config
from vllm_kvq.calib.capture import StatsCollector, load_model, run_windows
from vllm_kvq.calib.fit import build_artifact


def read_text(path: str | Path) -> str:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def token_windows(tokenizer, text: str, tokens: int, seq_len: int) -> list[list[int]]:
    """Consecutive windows of ``seq_len`` tokens, ``tokens`` in all (at least one)."""
    ids = tokenizer(text[: 12 * (tokens + seq_len)])["input_ids"]
    count = max(1, min(tokens // seq_len, len(ids) // seq_len))
    return [ids[i * seq_len : (i + 1) * seq_len] for i in range(count)]


def calibrate(model: str, data: str, out: str, *, tokens: int = 30000, seq_len: int = 2048,
              granularity: str = "kv_head", value_target: str = "proxy", clip: str = "fixed",
              k_clip: float = 0.96, v_clip: float = 0.92, group_size: int = 128, sink: int = 64,
              window: int = 256, device: str = "cpu", dtype: str = "float32",
              tokenizer: str | None = None, tiers: Tiers | None = None) -> Path:
    """Fit an OSCAR artifact; with ``tiers`` ({"k"|"v": [(width, bits), ...]}),
    a tiered one (kv_head granularity only). Tier errors raise ArtifactError
    before the model loads."""
    from transformers import AutoConfig, AutoTokenizer

    t0 = time.time()
    config = AutoConfig.from_pretrained(model)
    fp = model_fingerprint(config)
    if tiers is not None:
        if granularity != "kv_head":
            raise ArtifactError("--tiers needs --granularity kv_head (each KV head's own eigenbasis is cut into "
                                f"tiers); drop --granularity {granularity}")
        check_tiers(tiers, fp["head_dim"])
    tok = AutoTokenizer.from_pretrained(tokenizer or model)
    windows = token_windows(tok, read_text(data), tokens + seq_len, seq_len)
    if len(windows) < 2:
        raise ValueError(f"{data} gives only {len(windows)} window(s) of {seq_len} tokens; need 2 or more")
    fit_windows, held_out = windows[:-1], windows[-1:]
    collector = StatsCollector(text_config(config).num_key_value_heads, head_dim(text_config(config)), sink)
    net = load_model(model, device, getattr(torch, dtype), collector)
    run_windows(net, fit_windows, device, "query/output covariance")
    if value_target == "proxy":
        collector.mode = "proxy"
        run_windows(net, fit_windows, device, "score-weighted values")
    if clip == "fitted":
        collector.mode = "hold_out"
        run_windows(net, held_out, device, "held-out window")
    provenance = {
        "model": str(model), "data": str(data), "tokens": sum(map(len, fit_windows)), "seq_len": seq_len,
        "windows": len(fit_windows), "device": device, "dtype": dtype,
    }
    art = build_artifact(collector.layers, fp, granularity, value_target, clip, k_clip, v_clip,
                         group_size, sink, window, provenance, tiers)
    art.provenance["seconds"] = round(time.time() - t0, 1)
    return art.save(out)
