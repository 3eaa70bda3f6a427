"""From captured statistics to an artifact: rotations and clip ratios."""

from __future__ import annotations

import torch

from vllm_kvq.artifacts import OscarArtifact
from vllm_kvq.calib.capture import LayerStats
from vllm_kvq.calib.rotation import eigen_order, oscar_rotation, rotate_heads, tiered_rotation
from vllm_kvq.kernels.oscar.format import LayerTiers, TierPlan
from vllm_kvq.kernels.oscar.reference import fake_quantize, mix_values, mixed_probs

CLIP_GRID = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.8)


def value_covariance(stats: LayerStats, value_target: str) -> torch.Tensor:
    return {"exact": stats.cs, "proxy": stats.cv}[value_target]


def rotations(stats: LayerStats, granularity: str, value_target: str, tiers: LayerTiers | None = None,
              layer: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(R_K, eigenvalues), (R_V, eigenvalues)]`` for one layer: ``[D, D]``
    (layer) or ``[H, D, D]`` (kv_head); with ``tiers`` (kv_head only), tiered
    rotations of the same covariances."""
    out = []
    for kind, cov in (("k", stats.cq), ("v", value_covariance(stats, value_target))):
        if tiers is not None:
            pairs = [(tiered_rotation(u, getattr(tiers, kind), layer, h), ev)
                     for h, (u, ev) in enumerate(eigen_order(c.cpu()) for c in cov)]
        else:
            pairs = [oscar_rotation(c.cpu()) for c in (cov.mean(0, keepdim=True) if granularity == "layer" else cov)]
        r, ev = (torch.stack(x) for x in zip(*pairs))
        out.append((r[0], ev[0]) if granularity == "layer" else (r, ev))
    return out


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


def fit_clip(held: dict, rk, rv, sink: int, window: int) -> tuple[float, float, dict]:
    """Per-layer clip ratios of INT2 rows minimising the attention-output error
    on held-out tokens: keys first (values unclipped), then values at the
    chosen key ratio."""
    rows = lambda x, r: rotate_heads(x, r).transpose(0, 1).contiguous()  # noqa: E731  [H, T, D] -> [T, H, D]
    q, k, v = rows(held["q"], rk), rows(held["k"], rk).bfloat16().float(), rows(held["v"], rv).bfloat16().float()
    pos, plan = torch.arange(q.shape[0]), TierPlan.int2_only(k.shape[-1])
    probs = lambda k_lo: mixed_probs(q, pos, k, k_lo, sink, window, held["scale"])  # noqa: E731
    exact = mix_values(*probs(k), v, v)

    def error(p, v_lo) -> float:
        return ((mix_values(*p, v, v_lo) - exact).norm() / exact.norm()).item()

    v_plain = fake_quantize(v, plan, 1.0)
    k_err = {c: error(probs(fake_quantize(k, plan, c)), v_plain) for c in CLIP_GRID}
    ck = min(k_err, key=k_err.get)
    p = probs(fake_quantize(k, plan, ck))  # the softmax does not depend on the value clip
    v_err = {c: error(p, fake_quantize(v, plan, c)) for c in CLIP_GRID}
    return ck, min(v_err, key=v_err.get), {"k_error": k_err, "v_error": v_err}


def build_artifact(layers: dict[int, LayerStats], fingerprint: dict, granularity: str, value_target: str,
                   clip: str, k_clip: float, v_clip: float, sink: int, window: int,
                   provenance: dict, tiers: dict[int, LayerTiers] | None = None) -> OscarArtifact:
    """The artifact of captured statistics: rotations per layer (tiered where
    ``tiers`` gives each layer's plan), 0-bit means, clip ratios."""
    ks, vs, kc, vc, report = {}, {}, {}, {}, {}
    spectra, fill = {"k": {}, "v": {}}, {"k": {}, "v": {}}
    for idx in sorted(layers):
        st = layers[idx]
        plan = None if tiers is None else tiers[idx]
        (rk, spectra["k"][idx]), (rv, spectra["v"][idx]) = rotations(st, granularity, value_target, plan, idx)
        ks[idx], vs[idx] = rk, rv
        for kind, r in (("k", rk), ("v", rv)):
            if plan is not None and (f := zero_fill(st, kind, r, getattr(plan, kind))) is not None:
                fill[kind][idx] = f
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
