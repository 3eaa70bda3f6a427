"""Identify a model by the config fields that decide an artifact's shapes."""

from __future__ import annotations

FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def text_config(hf_config):
    """The language-model part of a (possibly multimodal) HF config."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def head_dim(cfg) -> int:
    d = getattr(cfg, "head_dim", None)
    return int(d) if d else cfg.hidden_size // cfg.num_attention_heads


def attention_layers(hf_config) -> list[int]:
    """Indices of the full-attention layers (all layers for dense models)."""
    cfg = text_config(hf_config)
    if types := getattr(cfg, "layer_types", None):
        return [i for i, t in enumerate(types) if t in ("full_attention", "attention")]
    interval = getattr(cfg, "full_attention_interval", None) or 1
    return [i for i in range(cfg.num_hidden_layers) if (i + 1) % interval == 0]


def model_fingerprint(hf_config) -> dict:
    """A JSON-able summary an artifact must match to be served with a model."""
    cfg = text_config(hf_config)
    fp = {"architecture": (getattr(hf_config, "architectures", None) or ["?"])[0]}
    fp.update({name: head_dim(cfg) if name == "head_dim" else getattr(cfg, name, None) for name in FIELDS})
    return {**fp, "attention_layers": attention_layers(hf_config)}


def gdn_layers(hf_config) -> list[int]:
    """Indices of the gated-delta-net (linear-attention) layers of a hybrid."""
    types = getattr(text_config(hf_config), "layer_types", None) or []
    return [i for i, t in enumerate(types) if t == "linear_attention"]


def gdn_geometry(hf_config) -> dict:
    """GDN state shape of a hybrid: layers, value/key heads, K and V (before TP)."""
    cfg, layers = text_config(hf_config), gdn_layers(hf_config)
    if not layers or getattr(cfg, "linear_num_value_heads", None) is None:
        raise ValueError("the model has no gated-delta-net layers (config lacks linear_attention layer_types "
                         "or linear_num_value_heads); STEPQuant needs a GDN hybrid such as Qwen3-Next or Qwen3.5")
    return {
        "layers": layers,
        "num_v_heads": int(cfg.linear_num_value_heads),
        "num_k_heads": int(cfg.linear_num_key_heads),
        "k_dim": int(cfg.linear_key_head_dim),
        "v_dim": int(cfg.linear_value_head_dim),
    }
