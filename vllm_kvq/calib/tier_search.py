"""Each layer's tiers under a byte budget, chosen from the error each
candidate makes on the held-out window: the KV-cache version of STEPQuant's
bit allocation.

For every layer and kind (K, V) each candidate plan (INT4, INT2 and 0-bit
widths in steps of 16) is scored by the attention-output error it causes
alone, with the other kind exact, over the held-out window's last queries:
the plan's own tiered rotation, bf16 rows, its INT2 tier clipped as served
and its 0-bit tier read back as the calibrated mean, through the serving read
rule (BF16 sink and window). A layer then takes the K and V plans whose bytes
per token add up to the budget with the least ``err_K^2 + err_V^2``. Every
layer gets the same bytes (vLLM gives every layer one page size), but not the
same split: a layer whose keys hurt more gives its keys more INT4.
"""

from __future__ import annotations

import torch

from vllm_kvq.calib.capture import LayerStats
from vllm_kvq.calib.fit import value_covariance, zero_fill
from vllm_kvq.calib.rotation import eigen_order, tiered_rotation
from vllm_kvq.kernels.oscar.format import WIDTH_STEP, LayerTiers, TierPlan
from vllm_kvq.kernels.oscar.reference import fake_quantize, mix_values, mixed_probs

QUERIES = 256
"""Held-out queries scored per candidate: the window's last (longest contexts)."""


def candidate_plans(head_dim: int) -> list[TierPlan]:
    """Every plan of INT4, INT2 and 0-bit widths in steps of WIDTH_STEP that stores something."""
    out = []
    for int4 in range(0, head_dim + 1, WIDTH_STEP):
        for int2 in range(0, head_dim - int4 + 1, WIDTH_STEP):
            if int4 + int2:
                out.append(TierPlan(int4, int2, head_dim - int4 - int2))
    return out


def sizes(head_dim: int) -> list[int]:
    """Bytes per token and KV head that some pair of K and V plans takes."""
    plans = candidate_plans(head_dim)
    return sorted({pk.row_bytes + pv.row_bytes for pk in plans for pv in plans})


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Rows ``[H*g, T, D]`` (heads grouped by KV head) times per-KV-head ``R [H, D, D]``."""
    h = r.shape[0]
    return (x.view(h, -1, *x.shape[1:]) @ r.unsqueeze(1).double()).view_as(x)


class LayerProbe:
    """A layer's held-out window and the pieces every candidate reuses."""

    def __init__(self, stats: LayerStats, layer: int, value_target: str, sink: int, window: int,
                 queries: int = QUERIES):
        held = stats.held_out
        if not held:
            raise ValueError(f"layer {layer}: no held-out window to score tier plans on")
        self.stats, self.layer, self.sink, self.window, self.scale = stats, layer, sink, window, held["scale"]
        self.q, self.k, self.v = (held[x].double() for x in "qkv")  # [Hq or H, T, D]
        t = self.q.shape[1]
        self.first = max(t - queries, 0)
        self.pos = torch.arange(self.first, t)
        self.orders = {"k": [eigen_order(c.cpu())[0] for c in stats.cq],
                       "v": [eigen_order(c.cpu())[0] for c in value_covariance(stats, value_target)]}
        rows = lambda x: x.transpose(0, 1).float()  # noqa: E731  [H, T, D] -> [T, H, D]
        k_bf = rows(self.k).bfloat16().float()
        self.exact_probs = mixed_probs(rows(self.q)[self.first:], self.pos, k_bf, k_bf, sink, window, self.scale)
        self.exact = mix_values(*self.exact_probs, rows(self.v), rows(self.v))

    def rotation(self, kind: str, plan: TierPlan) -> torch.Tensor:
        return torch.stack([tiered_rotation(u, plan, self.layer, h) for h, u in enumerate(self.orders[kind])])

    def error(self, kind: str, plan: TierPlan, clip: float) -> float:
        """Relative attention-output error of storing ``kind`` with ``plan`` (the other kind exact)."""
        r = self.rotation(kind, plan)
        fill = zero_fill(self.stats, kind, r, plan)
        rows = lambda x: x.transpose(0, 1).float()  # noqa: E731
        x = rows(_rotate(self.k if kind == "k" else self.v, r)).bfloat16().float()
        lo = fake_quantize(x, plan, clip, fill)
        if kind == "k":
            q = rows(_rotate(self.q, r))[self.first:]
            probs = mixed_probs(q, self.pos, x, lo, self.sink, self.window, self.scale)
            approx, exact = mix_values(*probs, rows(self.v), rows(self.v)), self.exact
        else:
            approx, exact = mix_values(*self.exact_probs, x, lo), mix_values(*self.exact_probs, x, x)
        return ((approx - exact).norm() / exact.norm()).item()


def choose(errors: dict[str, dict[TierPlan, float]], budget: int) -> tuple[LayerTiers, float]:
    """The K and V plans with ``budget`` bytes per token together and the least
    ``err_K^2 + err_V^2``; returns them and ``sqrt`` of that sum."""
    best = None
    for pk, ek in errors["k"].items():
        for pv, ev in errors["v"].items():
            if pk.row_bytes + pv.row_bytes == budget:
                cost = ek * ek + ev * ev
                if best is None or cost < best[0]:
                    best = (cost, LayerTiers(pk, pv))
    if best is None:
        raise ValueError(f"no pair of the candidate plans takes exactly {budget} bytes per token and KV head")
    return best[1], best[0] ** 0.5


def search(layers: dict[int, LayerStats], head_dim: int, budget: int, value_target: str, k_clip: float,
           v_clip: float, sink: int, window: int) -> tuple[dict[int, LayerTiers], dict]:
    """Each layer's tiers at ``budget`` bytes per token and KV head, and a
    report: per layer the chosen plans' errors and the predicted error."""
    plans = candidate_plans(head_dim)
    chosen, report = {}, {}
    for idx in sorted(layers):
        probe = LayerProbe(layers[idx], idx, value_target, sink, window)
        errors = {kind: {p: probe.error(kind, p, clip) for p in plans}
                  for kind, clip in (("k", k_clip), ("v", v_clip))}
        chosen[idx], predicted = choose(errors, budget)
        report[str(idx)] = {"tiers": str(chosen[idx]), "k_error": round(errors["k"][chosen[idx].k], 6),
                            "v_error": round(errors["v"][chosen[idx].v], 6), "predicted_error": round(predicted, 6)}
    return chosen, report
