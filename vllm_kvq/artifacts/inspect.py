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
    if art.tiers is not None:
        d = art.head_dim
        desc = "; ".join(f"{kind}=" + ",".join(f"{w}x{b}" for w, b in art.tiers[kind]) for kind in ("k", "v"))
        bits = {kind: sum(w * b for w, b in art.tiers[kind]) / d for kind in ("k", "v")}
        zero = ", ".join(f"{kind}_fill [{art.num_kv_heads}, {sum(w for w, b in art.tiers[kind] if b == 0)}]"
                         for kind in ("k", "v") if any(b == 0 for _, b in art.tiers[kind])) or "none"
        lines.append(f"tiers: {desc} (payload K {bits['k']:.2f} + V {bits['v']:.2f} bits/element before "
                     f"scales); 0-bit fills: {zero}")
    prov = {k: v for k, v in art.provenance.items() if k != "clip_fit"}
    if prov:
        lines.append(f"provenance: {prov}")
    lines.append("layer  k_clip  v_clip  K spectrum                          V spectrum")
    for layer in art.layers:
        ks = _spectrum(art.eigenvalues["k"][layer]) if layer in art.eigenvalues.get("k", {}) else "-"
        vs = _spectrum(art.eigenvalues["v"][layer]) if layer in art.eigenvalues.get("v", {}) else "-"
        lines.append(f"{layer:>5}  {art.k_clip[layer]:.3f}   {art.v_clip[layer]:.3f}   {ks:<34}  {vs}")
    return "\n".join(lines)


def stepquant_summary(plan) -> str:
    """Per GDN layer: widths per budget, pivots, ℓ / half-life, spread of w, record size."""
    from vllm_kvq.kernels.stepquant.format import fp32_state_bytes

    fp = plan.fingerprint
    hv, k, v = plan.num_v_heads, plan.k_dim, plan.v_dim
    fp32 = fp32_state_bytes(hv, k, v)
    s = plan.settings
    lines = [
        f"artifact {plan.source}: valid (schema v1, STEPQuant state plan)",
        f"model: {fp.get('architecture')} layers={fp.get('num_hidden_layers')} hidden={fp.get('hidden_size')}",
        f"GDN state: {len(plan.layers)} layers {plan.layers}, {hv} value heads"
        + (f" ({plan.num_k_heads} key heads)" if plan.num_k_heads else "") + f", K={k} V={v}, "
        f"FP32 {fp32:,} B per layer",
        f"budgets {plan.budgets}; horizon={s.get('horizon')} gamma={s.get('gamma')} "
        f"pivots/layer={s.get('pivots_per_layer')} (fraction {s.get('pivot_fraction', 0):.4f})",
    ]
    if plan.provenance:
        lines.append(f"provenance: {plan.provenance}")
    for layer in plan.layers:
        lines.append(f"layer {layer}:")
        if layer in plan.log_decay:
            ell = plan.log_decay[layer].double()
            hl = plan.half_life(layer)
            lines.append("  log decay  " + " ".join(f"{x:9.4f}" for x in ell.tolist()))
            lines.append("  half-life  " + " ".join(f"{x:9.2f}" for x in hl.tolist()) + "  tokens")
        w = plan.impact(layer).double()
        spread = (w.max(-1).values / w.min(-1).values).tolist()
        lines.append("  w max/min  " + " ".join(f"{x:9.2f}" for x in spread))
        for b in plan.budgets:
            layout = plan.layout(b, layer)
            piv = plan.pivots(b, layer)
            lines.append(
                f"  @{b}: widths {list(plan.head_bits(b, layer))} pivots {piv or '-'} "
                f"{layout.bits_per_value():.3f} bits/value, {layout.packed_bytes:,} B "
                f"({fp32 / layout.packed_bytes:.2f}x smaller than FP32)")
    for b in plan.budgets:
        page = max(plan.layout(b, layer).packed_bytes for layer in plan.layers)
        lines.append(f"@{b}: state page {page:,} B per layer and request (largest layer) vs {fp32:,} B FP32 "
                     f"({fp32 / page:.2f}x)")
    return "\n".join(lines)
