"""Human-readable summary of a validated artifact (``vllm-kvq inspect``)."""

from __future__ import annotations

import math

import torch

from vllm_kvq.artifacts.oscar import OscarArtifact


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
    search = art.provenance.get("tier_search", {}).get("layers", {})
    lines = [
        f"artifact {art.source}: valid",
        f"model: {fp.get('architecture')} layers={fp.get('num_hidden_layers')} hidden={fp.get('hidden_size')} "
        f"heads={fp.get('num_attention_heads')} kv_heads={fp.get('num_key_value_heads')} head_dim={fp.get('head_dim')}",
        f"rotations: {art.granularity} granularity over {len(art.layers)} attention layers {art.layers}",
        f"calibrated with sink={art.sink} window={art.window}; rows "
        + ("INT2 (OSCAR)" if art.tiers is None else "in tiers")
        + f", {art.bytes_per_token} B per token and KV head ({4 * art.bytes_per_token / art.head_dim:.3f} bits "
        "per element)",
    ]
    if "tier_search" in art.provenance:
        found = art.provenance["tier_search"]
        one = (f": {found['tiers']} for every layer, predicted KL {found['predicted_kl']:.1e} summed over layers"
               if "tiers" in found else "")  # artifacts searched per layer name no single plan
        lines.append(f"tiers chosen at {found['bytes_per_token']} B per token by the held-out window{one}; per "
                     "layer below: relative attention-output errors of K and V, and the predicted KL of the model's "
                     "next-token distribution from them")
    prov = {k: v for k, v in art.provenance.items() if k not in ("clip_fit", "tier_search")}
    lines += [f"provenance: {prov}"] if prov else []
    lines.append("layer  k_clip  v_clip  tiers                              held-out error                  "
                 "K spectrum                          V spectrum")
    for layer in art.layers:
        ks, vs = (_spectrum(art.eigenvalues[k][layer]) if layer in art.eigenvalues.get(k, {}) else "-" for k in "kv")
        tiers = "INT2" if art.tiers is None else str(art.tiers[layer])
        err = search.get(str(layer), {})
        predicted = (f"K {err['k_error']:.4f} V {err['v_error']:.4f} KL {err['predicted_kl']:.1e}"
                     if err else "-")
        lines.append(f"{layer:>5}  {art.k_clip[layer]:.3f}   {art.v_clip[layer]:.3f}   {tiers:<33}  "
                     f"{predicted:<30}  {ks:<34}  {vs}")
    return "\n".join(lines)


def stepquant_summary(plan) -> str:
    """Per GDN layer: widths per budget, pivots, ℓ / half-life, spread of w, record size."""
    from vllm_kvq.kernels.stepquant.format import fp32_state_bytes

    fp, s, hv, k, v = plan.fingerprint, plan.settings, plan.num_v_heads, plan.k_dim, plan.v_dim
    fp32 = fp32_state_bytes(hv, k, v)
    lines = [
        f"artifact {plan.source}: valid (STEPQuant state plan)",
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
        if layer in plan.log_decay:  # half-life: log 2 / (−ℓ) tokens (inf at ℓ = 0)
            ell = plan.log_decay[layer].double()
            half_life = torch.where(ell < 0, math.log(2.0) / (-ell), math.inf)
            lines.append("  log decay  " + " ".join(f"{x:9.4f}" for x in ell.tolist()))
            lines.append("  half-life  " + " ".join(f"{x:9.2f}" for x in half_life.tolist()) + "  tokens")
        w = plan.impact(layer).double()
        spread = (w.max(-1).values / w.min(-1).values).tolist()
        lines.append("  w max/min  " + " ".join(f"{x:9.2f}" for x in spread))
        for b in plan.budgets:
            layout = plan.layout(b, layer)
            lines.append(f"  @{b}: widths {list(plan.head_bits(b, layer))} pivots {plan.pivots(b, layer) or '-'} "
                         f"{layout.bits_per_value():.3f} bits/value, {layout.packed_bytes:,} B "
                         f"({fp32 / layout.packed_bytes:.2f}x smaller than FP32)")
    for b in plan.budgets:
        page = max(plan.layout(b, layer).packed_bytes for layer in plan.layers)
        lines.append(f"@{b}: state page {page:,} B per layer and request (largest layer) vs {fp32:,} B FP32 "
                     f"({fp32 / page:.2f}x)")
    return "\n".join(lines)
