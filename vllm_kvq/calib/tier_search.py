"""One tier plan for every layer under a byte budget, chosen from the error
each candidate makes on the held-out window: the KV-cache version of
STEPQuant's bit allocation.

For every layer and kind (K, V) each candidate plan (INT4, INT2 and 0-bit
widths in steps of 16) is scored by the attention-output error it causes
alone, with the other kind exact, over the held-out window's last queries:
the plan's own tiered rotation, bf16 rows, its INT2 tier clipped as served
and its 0-bit tier read back as the calibrated mean, through the serving read
rule (BF16 sink and window). Errors of keys and values, and of different
layers, do not cost the model alike, so each (layer, kind) gets a **sensitivity**:
how far the model's next-token distribution moves (KL) on the held-out
window when that kind of that layer alone is stored INT2, per unit of its
squared error (one forward each). Every layer then takes the same K and V
plans: the pair whose bytes per token add up to the budget with the least
predicted KL summed over layers, ``sum_l a_K,l err_K,l^2 + a_V,l err_V,l^2``.
One plan, not one per layer, because a single layer's predicted KL on one
window is overconfident: a per-layer choice left one layer's value
directions unstored where the window did not penalise it and other text
did. Keys store every direction (:func:`candidate_plans` says why).
"""

from __future__ import annotations

import torch

from vllm_kvq.calib.capture import LayerStats, StatsCollector, window_log_probs
from vllm_kvq.calib.fit import value_covariance, zero_fill
from vllm_kvq.calib.rotation import eigen_order, rotate_heads, tiered_rotation
from vllm_kvq.kernels.oscar.format import WIDTH_STEP, LayerTiers, TierPlan
from vllm_kvq.kernels.oscar.reference import fake_quantize, mix_values, mixed_attention, mixed_probs

QUERIES = 256
"""Held-out queries scored per candidate: the window's last (longest contexts)."""


def candidate_plans(head_dim: int, kind: str) -> list[TierPlan]:
    """Every plan of INT4, INT2 and 0-bit widths in steps of WIDTH_STEP that
    stores something; keys store every direction. An unstored key direction
    reads the calibrated mean, the same shift of every logit of a head, which
    the INT2-noise sensitivity prices far too low (a plan leaving 16 key
    directions unstored measured +3.7% perplexity against +1.0% for one
    storing them, where the prediction put them level)."""
    plans = [TierPlan(int4, int2, head_dim - int4 - int2) for int4 in range(0, head_dim + 1, WIDTH_STEP)
             for int2 in range(0, head_dim - int4 + 1, WIDTH_STEP) if int4 + int2]
    return [p for p in plans if p.zero == 0] if kind == "k" else plans


def sizes(head_dim: int) -> list[int]:
    """Bytes per token and KV head that some pair of K and V plans takes."""
    return sorted({pk.row_bytes + pv.row_bytes for pk in candidate_plans(head_dim, "k")
                   for pv in candidate_plans(head_dim, "v")})


class LayerProbe:
    """A layer's held-out window and the pieces every candidate reuses."""

    def __init__(self, stats: LayerStats, layer: int, value_target: str, sink: int, window: int):
        if not (held := stats.held_out):
            raise ValueError(f"layer {layer}: no held-out window to score tier plans on")
        self.stats, self.layer, self.sink, self.window, self.scale = stats, layer, sink, window, held["scale"]
        self.q, self.k, self.v = (held[x].double() for x in "qkv")  # [Hq or H, T, D]
        self.first = max(self.q.shape[1] - QUERIES, 0)
        self.pos = torch.arange(self.first, self.q.shape[1])
        self.orders = {"k": [eigen_order(c.cpu())[0] for c in stats.cq],
                       "v": [eigen_order(c.cpu())[0] for c in value_covariance(stats, value_target)]}
        rows = lambda x: x.transpose(0, 1).float()  # noqa: E731  [H, T, D] -> [T, H, D]
        k_bf = rows(self.k).bfloat16().float()
        self.exact_probs = mixed_probs(rows(self.q)[self.first:], self.pos, k_bf, k_bf, sink, window, self.scale)
        self.exact = mix_values(*self.exact_probs, rows(self.v), rows(self.v))

    def rotation(self, kind: str, plan: TierPlan) -> torch.Tensor:
        return torch.stack([tiered_rotation(u, plan, self.layer, h) for h, u in enumerate(self.orders[kind])])

    def attention(self, plans: dict[str, TierPlan], clips: dict[str, float]):
        """The layer's attention with each kind in ``plans`` stored that way
        (the others exact), as transformers calls it: ``(q [1, Hq, T, D], k,
        v [1, H, T, D], scaling) -> [1, T, Hq, D]`` in the model's basis."""
        rot = {kind: self.rotation(kind, plan).float() for kind, plan in plans.items()}
        fills = {kind: zero_fill(self.stats, kind, rot[kind], plan) for kind, plan in plans.items()}

        def run(query, key, value, scaling):
            dev, dtype = query.device, query.dtype
            x = {"q": query[0].float(), "k": key[0].float(), "v": value[0].float()}  # [H, T, D]
            for kind, r in rot.items():
                for name in ("qk" if kind == "k" else "v"):
                    x[name] = rotate_heads(x[name], r.to(dev))
            hi = {kind: x[kind].transpose(0, 1).bfloat16().float() for kind in "kv"}  # [T, H, D]
            lo = {**hi, **{kind: fake_quantize(hi[kind], plan, clips[kind], None if fills[kind] is None
                                               else fills[kind].to(dev)) for kind, plan in plans.items()}}
            pos = torch.arange(hi["k"].shape[0], device=dev)
            out = mixed_attention(x["q"].transpose(0, 1), pos, hi["k"], hi["v"], lo["k"], lo["v"], self.sink,
                                  self.window, scaling)
            if "v" in rot:  # back from the rotated basis
                r, (t, hq, d) = rot["v"].to(dev), out.shape
                out = (out.view(t, r.shape[0], -1, d) @ r.transpose(1, 2).unsqueeze(0)).view(t, hq, d)
            return out.unsqueeze(0).to(dtype)

        return run

    def error(self, kind: str, plan: TierPlan, clip: float) -> float:
        """Relative attention-output error of storing ``kind`` with ``plan`` (the other kind exact)."""
        r = self.rotation(kind, plan)
        fill = zero_fill(self.stats, kind, r, plan)
        rows = lambda x: x.transpose(0, 1).float()  # noqa: E731
        x = rows(rotate_heads(self.k if kind == "k" else self.v, r)).bfloat16().float()
        lo = fake_quantize(x, plan, clip, fill)
        if kind == "k":
            q = rows(rotate_heads(self.q, r))[self.first:]
            probs = mixed_probs(q, self.pos, x, lo, self.sink, self.window, self.scale)
            approx, exact = mix_values(*probs, rows(self.v), rows(self.v)), self.exact
        else:
            approx, exact = mix_values(*self.exact_probs, x, lo), mix_values(*self.exact_probs, x, x)
        return ((approx - exact).norm() / exact.norm()).item()


def kl_divergence(ref: torch.Tensor, other: torch.Tensor, rows: int = 256) -> float:
    """Mean over positions of KL(ref || other), both ``[T, vocab]`` log-probabilities."""
    total = 0.0
    for i in range(0, ref.shape[0], rows):
        p = ref[i : i + rows]
        total += (p.exp() * (p - other[i : i + rows])).sum().item()
    return total / ref.shape[0]


def sensitivities(net, collector: StatsCollector, held: list[int], probes: dict[int, "LayerProbe"], head_dim: int,
                  k_clip: float, v_clip: float, device: str) -> dict[int, dict[str, float]]:
    """Per layer and kind: how far the model's next-token distribution moves
    (mean KL from the exact one, over the held-out positions that read
    quantized rows) when that kind of that layer alone is stored INT2, per
    unit of its squared attention-output error. KL, not the loss difference,
    because it is the second-order part alone: never negative, and far less
    noisy on one window. At least a thousandth of the largest."""
    int2 = TierPlan.int2_only(head_dim)
    first = min(probe.sink + probe.window for probe in probes.values())
    if first >= len(held) - 1:
        raise ValueError(f"the held-out window ({len(held)} tokens) has no position past sink + window ({first})")
    raw = {}
    try:
        collector.perturb = {}  # every layer exact, and no statistics taken
        exact = window_log_probs(net, held, device, first)
        for layer, probe in probes.items():
            for kind, clip in (("k", k_clip), ("v", v_clip)):
                collector.perturb = {layer: probe.attention({kind: int2}, {kind: clip})}
                shift = kl_divergence(exact, window_log_probs(net, held, device, first))
                raw[layer, kind] = shift / max(probe.error(kind, int2, clip) ** 2, 1e-12)
    finally:
        collector.perturb = None
    floor = 1e-3 * max(raw.values(), default=1.0) or 1.0
    return {layer: {kind: max(raw[layer, kind], floor) for kind in "kv"} for layer in probes}


def choose(costs: dict[str, dict[TierPlan, float]], budget: int) -> tuple[LayerTiers, float]:
    """The K and V plans with ``budget`` bytes per token together and the
    least ``costs["k"][K] + costs["v"][V]``; returns them and that sum."""
    best = None
    for pk, ck in costs["k"].items():
        for pv, cv in costs["v"].items():
            if pk.row_bytes + pv.row_bytes == budget and (best is None or ck + cv < best[0]):
                best = (ck + cv, LayerTiers(pk, pv))
    if best is None:
        raise ValueError(f"no pair of the candidate plans takes exactly {budget} bytes per token and KV head")
    return best[1], best[0]


def search(probes: dict[int, LayerProbe], head_dim: int, budget: int, k_clip: float, v_clip: float,
           sensitivity: dict | None = None) -> tuple[dict[int, LayerTiers], dict]:
    """The one plan every layer takes at ``budget`` bytes per token and KV
    head (the least predicted KL summed over layers), and a report: the
    plan, its summed predicted KL, and per layer its errors, sensitivities
    and predicted KL (``sensitivity`` from :func:`sensitivities`; 1 for
    both kinds without)."""
    plans = {kind: candidate_plans(head_dim, kind) for kind in "kv"}
    clips = {"k": k_clip, "v": v_clip}
    weight = {idx: (sensitivity or {}).get(idx, {"k": 1.0, "v": 1.0}) for idx in probes}
    errors = {idx: {kind: {p: probe.error(kind, p, clips[kind]) for p in plans[kind]} for kind in "kv"}
              for idx, probe in sorted(probes.items())}
    costs = {kind: {p: sum(weight[idx][kind] * errors[idx][kind][p] ** 2 for idx in errors) for p in plans[kind]}
             for kind in "kv"}
    tiers, predicted = choose(costs, budget)
    layers = {}
    for idx, err in errors.items():
        ek, ev, w = err["k"][tiers.k], err["v"][tiers.v], weight[idx]
        layers[str(idx)] = {"k_error": round(ek, 6), "v_error": round(ev, 6), "k_sensitivity": round(w["k"], 6),
                            "v_sensitivity": round(w["v"], 6),
                            "predicted_kl": round(w["k"] * ek * ek + w["v"] * ev * ev, 8)}
    report = {"tiers": str(tiers), "predicted_kl": round(predicted, 8), "layers": layers}
    return {idx: tiers for idx in probes}, report
