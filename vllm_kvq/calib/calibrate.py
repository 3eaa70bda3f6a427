"""``vllm-kvq calibrate``: a checkpoint plus calibration text → an artifact."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import torch

from vllm_kvq.artifacts import ArtifactError, model_fingerprint
from vllm_kvq.calib.capture import StatsCollector, load_model, run_windows
from vllm_kvq.calib.fit import build_artifact
from vllm_kvq.calib.tier_search import LayerProbe, search, sensitivities, sizes
from vllm_kvq.kernels.oscar.format import LayerTiers, TierError

INT2 = "int2"
"""``tiers`` for a plain OSCAR INT2 artifact: every direction at 2 bits, rotated by U·H·P_br."""
BYTES_PER_TOKEN = 80


def read_text(path: str | Path) -> str:
    with (gzip.open if Path(path).suffix == ".gz" else open)(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def token_windows(tokenizer, text: str, tokens: int, seq_len: int) -> list[list[int]]:
    """Consecutive windows of ``seq_len`` tokens, ``tokens`` in all (at least one)."""
    ids = tokenizer(text[: 12 * (tokens + seq_len)])["input_ids"]
    count = max(1, min(tokens // seq_len, len(ids) // seq_len))
    return [ids[i * seq_len : (i + 1) * seq_len] for i in range(count)]


def calibrate(model: str, data: str, out: str, *, tokens: int = 30000, seq_len: int = 2048,
              granularity: str = "kv_head", value_target: str = "proxy", clip: str = "fixed",
              k_clip: float = 0.96, v_clip: float = 0.92, sink: int = 64, window: int = 256, device: str = "cpu",
              dtype: str = "float32", tokenizer: str | None = None, tiers: LayerTiers | str | None = None,
              bytes_per_token: int = BYTES_PER_TOKEN) -> Path:
    """Fit an artifact. ``tiers``: None searches the one plan every layer
    takes at ``bytes_per_token`` (:mod:`vllm_kvq.calib.tier_search`), a
    :class:`LayerTiers` serves every layer that plan, :data:`INT2` writes a
    plain OSCAR INT2 artifact (the only one that takes granularity ``layer``
    and fitted clip ratios). Bad options raise ArtifactError before the model
    loads."""
    from transformers import AutoConfig, AutoTokenizer

    t0 = time.time()
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"cannot read a model config from {model!r} ({type(e).__name__}); pass a checkpoint "
                            "directory with a config.json (or a Hugging Face model id)") from e
    if not Path(data).is_file():
        raise ArtifactError(f"--data {data}: no such file; pass a text file (or .gz) of the kind of text the model "
                            "will serve")
    fp = model_fingerprint(config)
    if tiers != INT2:
        if granularity != "kv_head":
            raise ArtifactError("tiers are cut in each KV head's own eigenbasis, so they need --granularity "
                                f"kv_head; drop --granularity {granularity} (or pass --tiers {INT2})")
        if clip == "fitted":
            raise ArtifactError("--clip fitted fits one clip ratio per layer to whole INT2 rows, not to tiers; "
                                f"drop --clip fitted (or pass --tiers {INT2})")
    try:
        if isinstance(tiers, LayerTiers):
            tiers.check(fp["head_dim"], "--tiers")
    except TierError as e:
        raise ArtifactError(str(e)) from e
    if tiers is None:
        if seq_len <= sink + window:
            raise ArtifactError(f"the tier search scores plans on held-out queries that read quantized rows: "
                                f"--seq-len {seq_len} must exceed --sink + --window ({sink + window})")
        if bytes_per_token not in sizes(fp["head_dim"]):
            raise ArtifactError(f"--bytes-per-token {bytes_per_token}: no tier plan takes exactly that many bytes "
                                f"per token and KV head at head size {fp['head_dim']}; possible sizes are "
                                f"{sizes(fp['head_dim'])}")
    tok = AutoTokenizer.from_pretrained(tokenizer or model)
    text = read_text(data)
    if not text.strip():
        raise ArtifactError(f"--data {data} is empty; pass a text file (or .gz) of the kind of text the model will "
                            "serve, a few tens of thousands of tokens")
    windows = token_windows(tok, text, tokens + seq_len, seq_len)
    if len(windows) < 2:
        raise ArtifactError(f"{data} gives only {len(windows)} window(s) of {seq_len} tokens; calibration needs 2 "
                            "or more: give more text, or a smaller --seq-len")
    fit_windows, held_out = windows[:-1], windows[-1:]
    collector = StatsCollector(fp["num_key_value_heads"], fp["head_dim"], sink)
    net = load_model(model, device, getattr(torch, dtype), collector)
    run_windows(net, fit_windows, device, "query/output covariance")
    if value_target == "proxy":
        collector.mode = "proxy"
        run_windows(net, fit_windows, device, "score-weighted values")
    if clip == "fitted" or tiers is None:
        collector.mode = "hold_out"
        run_windows(net, held_out, device, "held-out window")
    provenance = {
        "model": str(model), "data": str(data), "tokens": sum(map(len, fit_windows)), "seq_len": seq_len,
        "windows": len(fit_windows), "device": device, "dtype": dtype,
    }
    if tiers is None:
        probes = {i: LayerProbe(st, i, value_target, sink, window) for i, st in sorted(collector.layers.items())}
        weight = sensitivities(net, collector, held_out[0], probes, fp["head_dim"], k_clip, v_clip, device)
        per_layer, report = search(probes, fp["head_dim"], bytes_per_token, k_clip, v_clip, weight)
        provenance["tier_search"] = {"bytes_per_token": bytes_per_token, **report}
    else:
        per_layer = None if tiers == INT2 else {layer: tiers for layer in collector.layers}
    art = build_artifact(collector.layers, fp, granularity, value_target, clip, k_clip, v_clip, sink, window,
                         provenance, per_layer)
    art.provenance["seconds"] = round(time.time() - t0, 1)
    return art.save(out)
