"""Identify a model by the config fields that decide an artifact's shapes."""

from __future__ import annotations

FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


def text_config(hf_config):
    """The language-model part of a (possibly multimodal) HF config."""
    getter = getattr(hf_config, "get_text_config", None)
    return getter() if getter is not None else hf_config


def head_dim(cfg) -> int:
    d = getattr(cfg, "head_dim", None)
    return int(d) if d else cfg.hidden_size // cfg.num_attention_heads


def attention_layers(hf_config) -> list[int]:
    """Indices of the full-attention layers (all layers for dense models)."""
    cfg = text_config(hf_config)
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types) if t in ("full_attention", "attention")]
    interval = getattr(cfg, "full_attention_interval", None)
    if interval:
        return [i for i in range(n) if (i + 1) % interval == 0]
    return list(range(n))


def model_fingerprint(hf_config) -> dict:
    """A JSON-able summary an artifact must match to be served with a model."""
    cfg = text_config(hf_config)
    fp = {"architecture": (getattr(hf_config, "architectures", None) or ["?"])[0]}
    for name in FIELDS:
        fp[name] = head_dim(cfg) if name == "head_dim" else getattr(cfg, name, None)
    fp["attention_layers"] = attention_layers(hf_config)
    return fp
