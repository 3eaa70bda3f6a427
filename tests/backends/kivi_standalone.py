"""A standalone PyTorch model of the KIVI-style cache, for comparison with vLLM.

Written independently of ``vllm_kvq.kernels``: transformers runs the model and
a registered attention function quantizes the post-RoPE keys per channel over
complete 32-position groups (fp16 (scale, min), or int8 (min, max) in steps of
fp16(max |k| / 120)) and the values per token (after R_V, clipped, when an
artifact is given), then applies the read rule (key s in BF16 for query t iff
``s < sink`` or ``t - s < window``).
"""

import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from tests.backends.oscar_standalone import naive_int2


def channel_int2(keys: torch.Tensor, pairs: str = "fp16", positions: int = 32) -> torch.Tensor:
    """Min-max INT2 per channel over each complete run of ``positions`` rows;
    the incomplete tail is returned as is."""
    out = keys.clone()
    for s0 in range(0, keys.shape[0] - positions + 1, positions):
        seg = keys[s0 : s0 + positions]
        if pairs == "int8":
            step = (seg.abs().max() / 120).half().float()
            lo = torch.floor(seg.min(dim=0).values / step) * step
            scale = (torch.ceil(seg.max(dim=0).values / step) * step - lo) / 3
        else:
            lo = seg.min(dim=0).values
            scale = torch.clamp((seg.max(dim=0).values - lo) / 3, min=1e-8).half().float()
            lo = lo.half().float()
        out[s0 : s0 + positions] = torch.clamp(torch.floor((seg - lo) / scale + 0.5), 0, 3) * scale + lo
    return out


class KiviStandalone:
    """KIVI keys (per channel, ``pairs`` fp16 or int8) and per-token INT2 values, unrotated and unclipped."""

    def __init__(self, model_dir: str, sink: int, window: int, pairs: str = "fp16"):
        self.sink, self.window, self.pairs = sink, window, pairs
        name = "kvq_kivi_standalone"
        AttentionInterface.register(name, self._attention)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=name)
        self.model.eval()

    def _attention(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        _, hq, t, d = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        pos = torch.arange(t)
        dist = pos[:, None] - pos[None, :]
        use_bf16 = (pos[None, :] < self.sink) | (dist < self.window)
        out = torch.empty(t, hq, d)
        for h in range(hq):
            j = h // g
            k = key[0, j].float().bfloat16().float()
            v = value[0, j].float().bfloat16().float()
            k_lo, v_lo = channel_int2(k, self.pairs), naive_int2(v, 1.0)
            q = query[0, h].float()
            logits = torch.where(use_bf16, q @ k.T, q @ k_lo.T) * scaling
            p = torch.softmax(logits.masked_fill(dist < 0, float("-inf")), dim=-1)
            out[:, h] = (p * use_bf16) @ v + (p * ~use_bf16) @ v_lo
        return out.unsqueeze(0), None

    @torch.no_grad()
    def logprobs(self, token_ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
