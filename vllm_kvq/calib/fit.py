"""From captured statistics to an artifact: rotations and clip ratios."""

from __future__ import annotations

import torch

from vllm_kvq.artifacts import OscarArtifact
from vllm_kvq.calib.capture import LayerStats
from vllm_kvq.artifacts.schema import Tiers, zero_columns, zero_width
from vllm_kvq.calib.rotation import oscar_rotation, tiered_rotation
from vllm_kvq.kernels.oscar.reference import fake_quantize, mix_values, mixed_probs

CLIP_GRID = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.8)


def rotations(stats: LayerStats, granularity: str, value_target: str, tiers: Tiers | None = None,
              layer: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """R_K and R_V for one layer: ``[D, D]`` (layer) or ``[H, D, D]`` (kv_head);
    with ``tiers`` (kv_head only), tiered rotations of the same covariances."""
    v_cov = {"exact": stats.cs, "proxy": stats.cv}[value_target]
    if tiers is not None:
        if granularity != "kv_head":
            raise ValueError("tiered rotations need granularity kv_head")
        pairs_k = [tiered_rotation(c.cpu(), tiers["k"], layer, h) for h, c in enumerate(stats.cq)]
        pairs_v = [tiered_rotation(c.cpu(), tiers["v"], layer, h) for h, c in enumerate(v_cov)]
        rk, ek = torch.stack([p[0] for p in pairs_k]), torch.stack([p[1] for p in pairs_k])
        rv, ev = torch.stack([p[0] for p in pairs_v]), torch.stack([p[1] for p in pairs_v])
    elif granularity == "layer":
        rk, ek = oscar_rotation(stats.cq.mean(0).cpu())
        rv, ev = oscar_rotation(v_cov.mean(0).cpu())
    else:
        pairs_k = [oscar_rotation(c.cpu()) for c in stats.cq]
        pairs_v = [oscar_rotation(c.cpu()) for c in v_cov]
        rk, ek = torch.stack([p[0] for p in pairs_k]), torch.stack([p[1] for p in pairs_k])
        rv, ev = torch.stack([p[0] for p in pairs_v]), torch.stack([p[1] for p in pairs_v])
    return rk, rv, {"k_eigenvalues": ek, "v_eigenvalues": ev}


def fills(stats: LayerStats, rk: torch.Tensor, rv: torch.Tensor, tiers: Tiers) -> dict[str, torch.Tensor]:
    """Per kind with a 0-bit tier: ``[H, width0]`` fp32 = mean row (positions >= sink)
    times the stored rotation's 0-bit columns."""
    out = {}
    for kind, r, total in (("k", rk, stats.k_sum), ("v", rv, stats.v_sum)):
        if zero_width(tiers[kind]):
            if not stats.n_mean:
                raise ValueError("no calibration rows past the sink to take the 0-bit tiers' mean from; "
                                 "use a --seq-len longer than --sink")
            mean = total.cpu() / stats.n_mean  # [H, D] fp64
            cols = r.double()[:, :, zero_columns(tiers[kind])]  # [H, D, width0]
            out[kind] = (mean.unsqueeze(1) @ cols).squeeze(1).float()
    return out


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


def fit_clip(held: dict, rk, rv, group: int, sink: int, window: int) -> tuple[float, float, dict]:
    """Per-layer clip ratios minimising the attention-output error on held-out
    tokens: keys first (values unclipped), then values at the chosen key ratio."""
    h = HeldOut(held, rk, rv, sink, window)
    v_plain = fake_quantize(h.v, group, 1.0)
    k_err = {c: h.error(h.probs(fake_quantize(h.k, group, c)), v_plain) for c in CLIP_GRID}
    ck = min(k_err, key=k_err.get)
    probs = h.probs(fake_quantize(h.k, group, ck))  # the softmax does not depend on the value clip
    v_err = {c: h.error(probs, fake_quantize(h.v, group, c)) for c in CLIP_GRID}
    cv = min(v_err, key=v_err.get)
    return ck, cv, {"k_error": k_err, "v_error": v_err}


def build_artifact(layers: dict[int, LayerStats], fingerprint: dict, granularity: str, value_target: str,
                   clip: str, k_clip: float, v_clip: float, group: int, sink: int, window: int,
                   provenance: dict, tiers: Tiers | None = None) -> OscarArtifact:
    ks, vs, kc, vc, report = {}, {}, {}, {}, {}
    spectra = {"k": {}, "v": {}}
    fill = {}
    for idx in sorted(layers):
        st = layers[idx]
        rk, rv, ev = rotations(st, granularity, value_target, tiers, idx)
        ks[idx], vs[idx] = rk, rv
        if tiers is not None:
            for kind, f in fills(st, rk, rv, tiers).items():
                fill.setdefault(kind, {})[idx] = f
        spectra["k"][idx], spectra["v"][idx] = ev["k_eigenvalues"], ev["v_eigenvalues"]
        if clip == "fitted":
            kc[idx], vc[idx], errors = fit_clip(st.held_out, rk, rv, group, sink, window)
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
        group_size=group, sink=sink, window=window, provenance=prov, eigenvalues=spectra,
        tiers=tiers, fill=fill,
    )
