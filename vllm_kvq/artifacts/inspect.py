"""Human-readable summary of a validated artifact (``vllm-kvq inspect``)."""

from __future__ import annotations

import torch

from vllm_kvq.artifacts.schema import OscarArtifact


def _spectrum(ev: torch.Tensor) -> str:
    ev = ev.double().clamp_min(0)
    if ev.dim() == 2:
        ev = ev.mean(0)
    ev = ev.sort(descending=True).values
    total = ev.sum().item() or 1.0
    top = ev[:8].sum().item() / total
    return f"top-8 share {top:.2f}, max/mean {ev[0].item() / (total / ev.numel()):.1f}"


def summary(art: OscarArtifact) -> str:
    fp = art.fingerprint
    lines = [
        f"artifact {art.source}: valid (schema v1)",
        f"model: {fp.get('architecture')} layers={fp.get('num_hidden_layers')} hidden={fp.get('hidden_size')} "
        f"heads={fp.get('num_attention_heads')} kv_heads={fp.get('num_key_value_heads')} head_dim={fp.get('head_dim')}",
        f"rotations: {art.granularity} granularity over {len(art.layers)} attention layers {art.layers}",
        f"calibrated with group={art.group_size} sink={art.sink} window={art.window}",
    ]
    prov = {k: v for k, v in art.provenance.items() if k != "clip_fit"}
    if prov:
        lines.append(f"provenance: {prov}")
    lines.append("layer  k_clip  v_clip  K spectrum                          V spectrum")
    for layer in art.layers:
        ks = _spectrum(art.eigenvalues["k"][layer]) if layer in art.eigenvalues.get("k", {}) else "-"
        vs = _spectrum(art.eigenvalues["v"][layer]) if layer in art.eigenvalues.get("v", {}) else "-"
        lines.append(f"{layer:>5}  {art.k_clip[layer]:.3f}   {art.v_clip[layer]:.3f}   {ks:<34}  {vs}")
    return "\n".join(lines)
