"""The GDN state pool (``kvq.state``) in real vLLM on CUDA.

vLLM's CUDA build here has no MoE kernels, so the model is a dense
Qwen3.5-style text model (house-qwen3next's shape: 3 GDN layers per full
attention layer, 4 value heads of 128 x 128) with random weights: tokens are
meaningless, but they are deterministic, so the staged path can be compared
with vLLM's own FP32 states token for token.

1. ``check``: random prompts, greedy; FP32 states vs the FP16 pool and vs
   uniform INT6. Random weights make nearly every step a near tie,
   so the check is on log-probabilities: up to each prompt's first differing
   token, the FP16 pool's must be within 0.01 of FP32's on average.
2. ``speed``: a larger one (16 value heads of 128 x 128 per GDN layer), many requests decoding at once; decode
   tokens/s with FP32 states against the INT6 pool.

Each engine runs in its own process. Results: ``$OUT/cuda_state_check.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/kvq_out"))
TIE = 0.25

SMALL = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "dtype": "bfloat16",
    "hidden_size": 512, "intermediate_size": 768, "num_hidden_layers": 8, "head_dim": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6, "max_position_embeddings": 16384, "vocab_size": 8192, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1, "hidden_act": "silu", "attention_bias": False,
}
LARGE = {**SMALL, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 4, "linear_num_key_heads": 4, "linear_num_value_heads": 16,
         "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 4, "vocab_size": 32000}


def model_dir(cfg: dict, name: str, weights: bool = False) -> str:
    """A config (vLLM's dummy weights), or with ``weights`` a checkpoint of
    transformers' own random initialisation (std 0.02: activations, and so
    the GDN states, matter to the output; vLLM's dummy weights are too small
    for that)."""
    path = Path("/tmp") / name
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if weights and not (path / "model.safetensors").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        model.save_pretrained(path)
    return str(path)


def engine(job: dict) -> dict:
    import vllm_kvq

    vllm_kvq.register()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # the bundle has no FlashInfer: vLLM's Triton GDN prefill
    extra = {"gdn_prefill_backend": "triton"}
    kw = {"additional_config": {**extra, "kvq": job["kvq"]} if job["kvq"] else extra}
    fmt = "auto" if (Path(job["model"]) / "model.safetensors").exists() else "dummy"
    llm = LLM(model=job["model"], load_format=fmt, skip_tokenizer_init=True, dtype="bfloat16", attention_backend="TRITON_ATTN",
              mamba_ssm_cache_dtype="float32", enforce_eager=True, gpu_memory_utilization=job["mem"],
              max_model_len=job["max_len"], max_num_seqs=job["batch"], enable_prefix_caching=False, seed=0, **kw)
    g = __import__("torch").Generator().manual_seed(0)
    import torch

    prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, 8000, (job["prompt_len"],), generator=g).tolist())
               for _ in range(job["requests"])]
    params = SamplingParams(max_tokens=job["gen"], temperature=0, logprobs=2 if job["logprobs"] else None,
                            ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)  # warm-up
    t = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.time() - t
    res = {"wall_s": wall, "tokens": [o.outputs[0].token_ids for o in outs],
           "tok_s": job["requests"] * job["gen"] / wall}
    if job["logprobs"]:
        res["logprobs"] = [[{int(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs]
                           for o in outs]
    return res


def run(job: dict) -> dict:
    path = OUT / f"job_{abs(hash(json.dumps(job, sort_keys=True)))}.json"
    env = dict(os.environ, KVQ_STATE_JOB=json.dumps(job), KVQ_STATE_OUT=str(path))
    subprocess.run([sys.executable, __file__, "--engine"], env=env, check=True)
    res = json.loads(path.read_text())
    path.unlink()
    return res


def compare(got: dict, ref: dict) -> dict:
    compared, equal_prompts, diffs = 0, 0, []
    for a, b, lps in zip(got["tokens"], ref["tokens"], ref["logprobs"]):
        margins = [(lambda top: top[0] - top[1])(sorted(step.values(), reverse=True)) for step in lps]
        clear = next((i for i, m in enumerate(margins) if m < TIE), len(margins))
        ok = a[:clear] == b[:clear]
        equal_prompts += ok
        compared += clear
    for a, la, lb, b in zip(got["tokens"], got["logprobs"], ref["logprobs"], ref["tokens"]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        diffs += [abs(x[t] - y[t]) for x, y, t in zip(la[: same + 1], lb[: same + 1], b[: same + 1]) if t in x]
    return {"equal_up_to_tie": equal_prompts, "prompts": len(ref["tokens"]), "tokens_compared": compared,
            "whole_sequences_equal": sum(a == b for a, b in zip(got["tokens"], ref["tokens"])),
            "dlogprob_mean": sum(diffs) / max(len(diffs), 1), "dlogprob_max": max(diffs, default=0.0)}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    steps = sys.argv[1:] or ["check", "speed"]
    report = {}
    if "check" in steps:
        small = model_dir(SMALL, "kvq_gdn_small", weights=True)
        base = dict(model=small, mem=0.2, max_len=2048, batch=16, requests=16, prompt_len=400, gen=32, logprobs=True)
        ref = run({**base, "kvq": None})
        report["check"] = {}
        for name, kvq in (("fp16_pool", {"state": "uniform", "state_bits": 16}),
                          ("uniform_int6", {"state": "uniform", "state_bits": 6})):
            report["check"][name] = compare(run({**base, "kvq": kvq}), ref)
            print(name, report["check"][name], flush=True)
        report["check"]["ok"] = report["check"]["fp16_pool"]["dlogprob_mean"] < 0.01
    if "speed" in steps:
        large = model_dir(LARGE, "kvq_gdn_large")
        base = dict(model=large, mem=0.5, max_len=1024, batch=256, requests=256, prompt_len=256, gen=64, logprobs=False)
        report["speed"] = {"config": {k: LARGE[k] for k in ("hidden_size", "num_hidden_layers", "linear_num_value_heads")},
                           **{k: base[k] for k in ("requests", "prompt_len", "gen")}}
        for name, kvq in (("fp32_state", None), ("uniform_int6", {"state": "uniform", "state_bits": 6})):
            r = run({**base, "kvq": kvq})
            report["speed"][name] = {"tok_s": r["tok_s"], "wall_s": r["wall_s"]}
            print(name, report["speed"][name], flush=True)
    (OUT / "cuda_state_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if "--engine" in sys.argv:
        result = engine(json.loads(os.environ["KVQ_STATE_JOB"]))
        Path(os.environ["KVQ_STATE_OUT"]).write_text(json.dumps(result))
    else:
        main()
