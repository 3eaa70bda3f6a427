"""A standalone PyTorch model of OSCAR attention, for comparison with vLLM.

Written independently of ``vllm_kvq.kernels``: transformers runs the model,
and a registered attention function applies the OSCAR math to the post-RoPE
q/k/v of the whole sequence at once. Every query t reads key s in BF16 when
``s < sink`` or ``t - s < window`` and as dequantized INT2 otherwise.
"""

import torch
from transformers import AttentionInterface, AutoModelForCausalLM


def _minmax(seg: torch.Tensor, levels: int) -> torch.Tensor:
    lo = seg.min(dim=-1, keepdim=True).values
    hi = seg.max(dim=-1, keepdim=True).values
    scale = torch.clamp((hi - lo) / levels, min=1e-8).half().float()
    lo = lo.half().float()
    return torch.clamp(torch.floor((seg - lo) / scale + 0.5), 0, levels) * scale + lo


def _clip(x: torch.Tensor, clip: float) -> torch.Tensor:
    if clip >= 1.0:
        return x
    d = x.shape[-1]
    thr = x.abs().sort(dim=-1).values[..., min(int(clip * d), d - 1)].unsqueeze(-1)
    return torch.where(x > thr, thr, torch.where(x < -thr, -thr, x))


def naive_int2(rows: torch.Tensor, clip: float) -> torch.Tensor:
    """Clip each row, then min-max INT2 over the row with fp16 (scale, min)."""
    return _minmax(_clip(rows, clip), 3)


def naive_tiers(rows: torch.Tensor, tiers: list[tuple[int, int]], clip: float, fill) -> torch.Tensor:
    """Rows cut into ``(width, bits)`` tiers, strongest first: INT4 min-max
    (15 levels, unclipped), INT2 clipped then min-max, 0-bit ``fill``."""
    parts, at = [], 0
    for width, bits in tiers:
        seg = rows[..., at : at + width]
        if bits == 4:
            parts.append(_minmax(seg, 15))
        elif bits == 2:
            parts.append(_minmax(_clip(seg, clip), 3))
        else:
            parts.append(fill.float().expand_as(seg))
        at += width
    return torch.cat(parts, dim=-1)


class OscarStandalone:
    """``codec(kind, layer, kv_head, rows)``: the rows a reader sees (default:
    :func:`naive_int2` with the artifact's clip ratios)."""

    def __init__(self, model_dir: str, artifact, sink: int, window: int, codec=None):
        self.art, self.sink, self.window = artifact, sink, window
        self.codec = codec or (lambda kind, layer, head, rows: naive_int2(
            rows, (artifact.k_clip if kind == "k" else artifact.v_clip)[layer]))
        name = "kvq_oscar_standalone"
        AttentionInterface.register(name, self._attention)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=name)
        self.model.eval()

    def _attention(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        layer = module.layer_idx
        _, hq, t, d = query.shape
        hkv = key.shape[1]
        heads = list(range(hkv))
        rk = self.art.rotation_for("k", layer, heads)
        rv = self.art.rotation_for("v", layer, heads)
        g = hq // hkv
        out = torch.empty(t, hq, d)
        pos = torch.arange(t)
        dist = pos[:, None] - pos[None, :]
        use_bf16 = (pos[None, :] < self.sink) | (dist < self.window)
        for h in range(hq):
            j = h // g
            q = query[0, h].float() @ rk[j]
            k = (key[0, j].float() @ rk[j]).bfloat16().float()
            v = (value[0, j].float() @ rv[j]).bfloat16().float()
            k_lo = self.codec("k", layer, j, k)
            v_lo = self.codec("v", layer, j, v)
            logits = torch.where(use_bf16, q @ k.T, q @ k_lo.T) * scaling
            logits = logits.masked_fill(dist < 0, float("-inf"))
            p = torch.softmax(logits, dim=-1)
            o = (p * use_bf16) @ v + (p * ~use_bf16) @ v_lo
            out[:, h] = o @ rv[j].T
        return out.unsqueeze(0), None

    @torch.no_grad()
    def logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log p(token[i+1] | tokens[:i+1]) for every position, and the logits."""
        ids = torch.tensor([token_ids])
        logits = self.model(ids).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


def compare_with_standalone(outs, ref) -> dict:
    """vLLM outputs (with ``prompt_logprobs`` and greedy tokens) against a
    standalone model ``ref`` (``.logprobs(ids)``, ``.window``): |dlogprob| of
    every prompt token, the same model with nothing quantized as the size of
    the effect being checked, and greedy agreement on the generated tokens."""
    ids_all = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    logprobs = [ref.logprobs(ids) for ids in ids_all]
    window, ref.window = ref.window, 1 << 20
    exact = [ref.logprobs(ids) for ids in ids_all]
    ref.window = window
    diffs, effect, agree, total = [], [], 0, 0
    for out, lp, lx in zip(outs, logprobs, exact):
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            tok = out.prompt_token_ids[i]
            diffs.append(abs(entry[tok].logprob - lp[i - 1, tok].item()))
            effect.append(abs(lx[i - 1, tok].item() - lp[i - 1, tok].item()))
        for j, tok in enumerate(out.outputs[0].token_ids):
            total += 1
            agree += int(lp[len(out.prompt_token_ids) - 1 + j].argmax().item() == tok)
    diffs.sort()
    return {"tokens": len(diffs), "mean": sum(diffs) / len(diffs), "p99": diffs[int(0.99 * len(diffs))],
            "max": diffs[-1], "effect": sum(effect) / len(effect), "agree": agree, "total": total}


def assert_matches_standalone(llm, prompts, ref, params, label: str) -> dict:
    """Generate ``prompts`` in vLLM with ``params`` (prompt logprobs, greedy),
    compare with the standalone model ``ref`` and hold vLLM to it.

    Rounding differences upstream (RoPE, norms, folded weights) flip a bf16
    ulp now and then, which INT2 can amplify; the agreement must still be an
    order of magnitude tighter than the quantization effect itself, and every
    greedy token the standalone model's."""
    c = compare_with_standalone(llm.generate(prompts, params, use_tqdm=False), ref)
    print(f"\nvLLM {label} vs standalone: {c['tokens']} prompt tokens, |dlogprob| mean {c['mean']:.5f} "
          f"p99 {c['p99']:.5f} max {c['max']:.4f}; greedy agreement {c['agree']}/{c['total']}; quantized vs BF16 "
          f"in the standalone model: mean {c['effect']:.5f}")
    assert c["mean"] < 0.1 * c["effect"] and c["mean"] < 5e-3 and c["p99"] < 3e-2
    assert c["agree"] == c["total"]
    return c
