"""From captured statistics to an artifact: rotations and clip ratios."""

from __future__ import annotations

import torch

from vllm_kvq.artifacts import OscarArtifact
from vllm_kvq.calib.capture import LayerStats
from vllm_kvq.calib.rotation import eigen_order, oscar_rotation, tiered_rotation
from vllm_kvq.kernels.oscar.format import LayerTiers, TierPlan
from vllm_kvq.kernels.oscar.reference import fake_quantize, mix_values, mixed_probs

CLIP_GRID = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.8)


def value_covariance(stats: LayerStats, value_target: str) -> torch.Tensor:
    return {"exact": stats.cs, "proxy": stats.cv}[value_target]


def rotations(stats: LayerStats, granularity: str, value_target: str, tiers: LayerTiers | None = None,
              layer: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """R_K and R_V for one layer: ``[D, D]`` (layer) or ``[H, D, D]`` (kv_head);
    with ``tiers`` (kv_head only), tiered rotations of the same covariances."""
    v_cov = value_covariance(stats, value_target)
    if tiers is not None:
        if granularity != "kv_head":
            raise ValueError("tiered rotations need granularity kv_head")
        out = {}
        for kind, covs in (("k", stats.cq), ("v", v_cov)):
            orders = [eigen_order(c.cpu()) for c in covs]
            plan = getattr(tiers, kind)
            out[kind] = (torch.stack([tiered_rotation(u, plan, layer, h) for h, (u, _) in enumerate(orders)]),
                         torch.stack([ev for _, ev in orders]))
        (rk, ek), (rv, ev) = out["k"], out["v"]
    elif granularity == "layer":
        rk, ek = oscar_rotation(stats.cq.mean(0).cpu())
        rv, ev = oscar_rotation(v_cov.mean(0).cpu())
    else:
        pairs_k = [oscar_rotation(c.cpu()) for c in stats.cq]
        pairs_v = [oscar_rotation(c.cpu()) for c in v_cov]
        rk, ek = torch.stack([p[0] for p in pairs_k]), torch.stack([p[1] for p in pairs_k])
        rv, ev = torch.stack([p[0] for p in pairs_v]), torch.stack([p[1] for p in pairs_v])
    return rk, rv, {"k_eigenvalues": ek, "v_eigenvalues": ev}


def zero_fill(stats: LayerStats, kind: str, rotation: torch.Tensor, plan: TierPlan) -> torch.Tensor | None:
    """``[H, zero]`` fp32: the mean row (positions >= sink) times the rotation's
    0-bit columns (the last ``plan.zero``); None without a 0-bit tier."""
    if not plan.zero:
        return None
    if not stats.n_mean:
        raise ValueError("no calibration rows past the sink to take the 0-bit tiers' mean from; "
                         "use a --seq-len longer than --sink")
    mean = (stats.k_sum if kind == "k" else stats.v_sum).cpu() / stats.n_mean  # [H, D] fp64
    cols = rotation.double()[..., -plan.zero:]  # [H, D, zero]
    return (mean.unsqueeze(1) @ cols).squeeze(1).float()


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x ``[H*g, T, D]`` (heads grouped by KV head) times R ``[D, D]``/``[H, D, D]``."""
    if r.dim() == 2:
        return x @ r
    h = r.shape[0]
    return (x.view(h, -1, *x.shape[1:]) @ r.unsqueeze(1)).view_as(x)


class HeldOut:
    """One held-out window in the rotated basis, with its exact attention output."""

    def __init__(self, held: dict, rk, rv, sink: int, window: int):
        perm = lambda x: x.transpose(0, 1).contiguous()  # [H, T, D] -> [T, H, D]
        self.q = perm(_rotate(held["q"], rk))
        self.k = perm(_rotate(held["k"], rk)).bfloat16().float()
        self.v = perm(_rotate(held["v"], rv)).bfloat16().float()
        self.pos = torch.arange(self.q.shape[0])
        self.sink, self.window, self.scale = sink, window, held["scale"]
        self.exact = mix_values(*self.probs(self.k), self.v, self.v)

    def probs(self, k_lo):
        return mixed_probs(self.q, self.pos, self.k, k_lo, self.sink, self.window, self.scale)

    def error(self, probs, v_lo) -> float:
        """Relative attention-output error of the INT2 cache."""
        approx = mix_values(*probs, self.v, v_lo)
        return ((approx - self.exact).norm() / self.exact.norm()).item()


def fit_clip(held: dict, rk, rv, sink: int, window: int) -> tuple[float, float, dict]:
    """Per-layer clip ratios of INT2 rows minimising the attention-output error
    on held-out tokens: keys first (values unclipped), then values at the
    chosen key ratio."""
    h = HeldOut(held, rk, rv, sink, window)
    plan = TierPlan.int2_only(h.k.shape[-1])
    v_plain = fake_quantize(h.v, plan, 1.0)
    k_err = {c: h.error(h.probs(fake_quantize(h.k, plan, c)), v_plain) for c in CLIP_GRID}
    ck = min(k_err, key=k_err.get)
    probs = h.probs(fake_quantize(h.k, plan, ck))  # the softmax does not depend on the value clip
    v_err = {c: h.error(probs, fake_quantize(h.v, plan, c)) for c in CLIP_GRID}
    cv = min(v_err, key=v_err.get)
    return ck, cv, {"k_error": k_err, "v_error": v_err}


def build_artifact(layers: dict[int, LayerStats], fingerprint: dict, granularity: str, value_target: str,
                   clip: str, k_clip: float, v_clip: float, sink: int, window: int,
                   provenance: dict, tiers: dict[int, LayerTiers] | None = None) -> OscarArtifact:
    """The artifact of captured statistics: rotations per layer (tiered where
    ``tiers`` gives each layer's plan), 0-bit means, clip ratios."""
    ks, vs, kc, vc, report = {}, {}, {}, {}, {}
    spectra = {"k": {}, "v": {}}
    fill = {"k": {}, "v": {}}
    for idx in sorted(layers):
        st = layers[idx]
        plan = None if tiers is None else tiers[idx]
        rk, rv, ev = rotations(st, granularity, value_target, plan, idx)
        ks[idx], vs[idx] = rk, rv
        if plan is not None:
            for kind, r in (("k", rk), ("v", rv)):
                f = zero_fill(st, kind, r, getattr(plan, kind))
                if f is not None:
                    fill[kind][idx] = f
        spectra["k"][idx], spectra["v"][idx] = ev["k_eigenvalues"], ev["v_eigenvalues"]
        if clip == "fitted":
            kc[idx], vc[idx], errors = fit_clip(st.held_out, rk, rv, sink, window)
            report[idx] = errors
        else:
            kc[idx], vc[idx] = k_clip, v_clip
    prov = dict(provenance, granularity=granularity, value_target=value_target, clip=clip)
    if report:
        prov["clip_fit"] = {str(i): {k: {str(c): round(e, 6) for c, e in v.items()} for k, v in r.items()}
                            for i, r in report.items()}
    return OscarArtifact(
        fingerprint=fingerprint, head_dim=fingerprint["head_dim"], num_kv_heads=fingerprint["num_key_value_heads"],
        layers=sorted(layers), granularity=granularity, k_rotation=ks, v_rotation=vs, k_clip=kc, v_clip=vc,
        sink=sink, window=window, provenance=prov, eigenvalues=spectra, tiers=tiers,
        fill={kind: t for kind, t in fill.items() if t},
    )
