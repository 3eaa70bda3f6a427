"""Data-free rotations: identity (naive INT2) and Sylvester Hadamard."""

from __future__ import annotations

import math

import torch

from vllm_kvq.artifacts.oscar import OscarArtifact


def hadamard(d: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size d (a power of two)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(d)).float()


def builtin_artifact(fingerprint: dict, mode: str, k_clip: float = 1.0, v_clip: float = 1.0) -> OscarArtifact:
    """An in-memory artifact with the same rotation on every layer of a model
    (given by its :func:`model_fingerprint`)."""
    d, layers = fingerprint["head_dim"], list(fingerprint["attention_layers"])
    if mode not in ("none", "hadamard"):
        raise ValueError(f"no built-in rotation {mode!r}")
    rot = torch.eye(d) if mode == "none" else hadamard(d)
    return OscarArtifact(
        fingerprint=dict(fingerprint), head_dim=d, num_kv_heads=fingerprint["num_key_value_heads"], layers=layers,
        granularity="layer", k_rotation=dict.fromkeys(layers, rot), v_rotation=dict.fromkeys(layers, rot),
        k_clip=dict.fromkeys(layers, k_clip), v_clip=dict.fromkeys(layers, v_clip), provenance={"builtin": mode},
        source=f"<builtin {mode}>")
