"""Stream attention statistics out of a transformers forward pass.

A registered attention function sees every full-attention layer's queries,
keys and values after RoPE (and q/k norm), runs exact causal attention for the
model, and folds what calibration needs into fp64 accumulators per layer and
KV head, so activations are never kept:

* ``cq``: query covariance, grouped for GQA (Σ qᵀq over the KV head's queries);
* ``cs``: attention-output covariance ``Vᵀ SᵀS V`` (the exact value target);
* ``cv``: score-weighted value covariance ``Vᵀ diag(k C_Q kᵀ) V`` (the proxy;
  needs C_Q, so it takes a second pass);
* ``k_sum``/``v_sum``: first moments of the unrotated key and value rows at
  positions ``>= sink`` (``n_mean`` rows), gathered in the covariance pass;
  their means fill the 0-bit tiers of a tiered artifact.

The last window is held out: its rotated-space inputs are kept (one window
per layer) to fit clip ratios on tokens the covariances never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

ATTN_NAME = "kvq_calibration"


@dataclass
class LayerStats:
    cq: torch.Tensor  # [Hkv, D, D] fp64
    cs: torch.Tensor
    cv: torch.Tensor
    k_sum: torch.Tensor | None = None  # [Hkv, D] fp64, rows at positions >= sink
    v_sum: torch.Tensor | None = None
    n_q: int = 0
    n_mean: int = 0  # rows per KV head in k_sum / v_sum
    held_out: dict = field(default_factory=dict)  # q, k, v of one window, fp32, [H, T, D]


class StatsCollector:
    """The attention function transformers calls; accumulates per layer."""

    def __init__(self, num_kv_heads: int, head_dim: int, sink: int = 64):
        self.h, self.d, self.sink = num_kv_heads, head_dim, sink
        self.layers: dict[int, LayerStats] = {}
        self.mode = "covariance"  # or "proxy" (second pass) or "hold_out"
        self.perturb = None  # {layer: attention(q, k, v, scaling) -> [B, T, Hq, D]}: those layers' attention replaced

    def stats(self, layer: int, device) -> LayerStats:
        if layer not in self.layers:
            z = lambda *shape: torch.zeros(self.h, *shape, dtype=torch.float64, device=device)  # noqa: E731
            d = self.d
            self.layers[layer] = LayerStats(z(d, d), z(d, d), z(d, d), z(d), z(d))
        return self.layers[layer]

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if self.perturb is not None and module.layer_idx in self.perturb:
            return self.perturb[module.layer_idx](query, key, value, scaling), None
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        if self.perturb is not None:  # the other layers exact, and no statistics taken
            return out.transpose(1, 2), None
        (b, hq, t, d), h = query.shape, key.shape[1]
        st, g = self.stats(module.layer_idx, query.device), hq // h
        q64 = query[0].double().reshape(h, g * t, d)  # queries of each KV head's group
        k64, v64 = key[0].double(), value[0].double()
        if self.mode == "covariance":
            o64 = out[0].double().reshape(h, g * t, d)
            st.cq += q64.transpose(1, 2) @ q64
            st.cs += o64.transpose(1, 2) @ o64
            st.n_q += g * t
            st.k_sum += k64[:, self.sink:].sum(1)
            st.v_sum += v64[:, self.sink:].sum(1)
            st.n_mean += max(t - self.sink, 0)
        elif self.mode == "proxy":
            c_q = st.cq / max(st.n_q, 1)
            w = torch.einsum("htd,hde,hte->ht", k64, c_q, k64)  # E_q[(q·k_t)^2]
            st.cv += (v64 * w.unsqueeze(-1)).transpose(1, 2) @ v64
        else:
            st.held_out = {"q": query[0].float().cpu(), "k": key[0].float().cpu(), "v": value[0].float().cpu(),
                           "scale": float(scaling)}
        return out.transpose(1, 2), None


def load_model(model_dir: str, device: str, dtype: torch.dtype, collector: StatsCollector | None = None):
    """The checkpoint in transformers; with a ``collector``, its attention runs through it."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    if collector is not None:
        AttentionInterface.register(ATTN_NAME, collector)
    extra = {} if collector is None else {"attn_implementation": ATTN_NAME}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra).to(device).eval()


@torch.no_grad()
def window_log_probs(model, ids: list[int], device: str, first: int = 0) -> torch.Tensor:
    """``[T - first, vocab]`` fp32: the model's next-token log-probabilities at
    positions ``first ..`` of one window."""
    logits = model(torch.tensor([ids], device=device), use_cache=False).logits[0, first:]
    return F.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def run_windows(model, windows: list[list[int]], device: str, desc: str) -> None:
    from tqdm import tqdm

    for ids in tqdm(windows, desc=desc, unit="window"):  # the decoder stack: no logits (lm_head: ~20% of FLOPs)
        model.base_model(torch.tensor([ids], device=device), use_cache=False)
