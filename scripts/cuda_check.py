"""The OSCAR backend in real vLLM on CUDA (reference ops on CUDA tensors).

Runs on a GPU machine with vLLM 0.32 (``bash scripts/cuda_check.sh``):

1. the reference ops give the same bytes and outputs on CUDA as on CPU;
2. a random-weight Qwen3 (house-qwen3 shapes) generates with TRITON_ATTN and
   with OSCAR; with sink + window >= length the greedy tokens must be equal;
3. OSCAR with a small window (INT2 active) generates, and its distance to
   BF16 is reported.

Each engine runs in its own process. Results go to ``$OUT/cuda_check.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MODEL_DIR = Path("/tmp/kvq_cuda_model")
OUT = Path(os.environ.get("OUT", "/tmp/kvq_out"))


def make_model() -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=16384,
        initializer_range=0.08, tie_word_embeddings=True, rope_theta=1e6, torch_dtype="bfloat16",
    )
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(MODEL_DIR, safe_serialization=True)


def prompts(n: int = 8, length: int = 200) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 8000, (length,), generator=g).tolist() for _ in range(n)]


def run_engine(backend: str, kvq: str, out: str) -> None:
    import vllm_kvq

    vllm_kvq.register()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"attention_backend": backend}
    if backend == "OSCAR":
        kw["additional_config"] = {"kvq": json.loads(kvq)}
    llm = LLM(model=str(MODEL_DIR), skip_tokenizer_init=True, max_model_len=4096, gpu_memory_utilization=0.3,
              enforce_eager=True, enable_prefix_caching=False, block_size=128, seed=0, **kw)
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], params, use_tqdm=False)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs],
        "kv_cache_size_tokens": llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens,
    }
    Path(out).write_text(json.dumps(result))


def check_ops() -> dict:
    import torch

    from vllm_kvq.kernels.oscar import reference as ref
    from vllm_kvq.kernels.oscar.format import OscarFormat

    torch.manual_seed(0)
    fmt = OscarFormat(head_size=128, group_size=128, block_size=128, sink=16, window=64)
    n, h, g = 700, 8, 4
    q, k, v = torch.randn(n, h * g, 128), torch.randn(n, h, 128), torch.randn(n, h, 128)
    row = torch.arange(1, 1 + fmt.state_blocks + 6, dtype=torch.int32)
    res = {}
    for dev in ("cpu", "cuda"):
        cache = torch.zeros(32, h, 128, fmt.bytes_per_token, dtype=torch.uint8, device=dev)
        outs, start = [], 0
        for size in (300, 64, 1, 335):
            outs.append(ref.attend_and_write(ref.PageViews(cache, fmt), fmt, row.to(dev), start,
                                             q[start:start + size].to(dev), k[start:start + size].to(dev),
                                             v[start:start + size].to(dev), 0.96, 0.92, 0.088))
            start += size
        res[dev] = (cache.cpu(), torch.cat(outs).cpu())
    data = row[fmt.state_blocks:].long()
    same_codes = bool(torch.equal(res["cpu"][0][data], res["cuda"][0][data]))
    max_out = (res["cpu"][1] - res["cuda"][1]).abs().max().item()
    return {"pages_identical_cpu_vs_cuda": same_codes, "max_abs_output_diff_cpu_vs_cuda": max_out}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        run_engine(*sys.argv[2:5])
        return
    OUT.mkdir(parents=True, exist_ok=True)
    summary = {"ops": check_ops()}
    print("ops:", summary["ops"], flush=True)
    make_model()
    runs = {
        "bf16": ("TRITON_ATTN", "{}"),
        "oscar_exact": ("OSCAR", json.dumps({"rotation": "hadamard"})),
        "oscar_int2": ("OSCAR", json.dumps({"rotation": "hadamard", "sink": 16, "window": 32,
                                            "k_clip": 0.96, "v_clip": 0.92})),
    }
    results = {}
    for name, (backend, kvq) in runs.items():
        path = OUT / f"cuda_{name}.json"
        subprocess.run([sys.executable, __file__, "engine", backend, kvq, str(path)], check=True)
        results[name] = json.loads(path.read_text())
    base = results["bf16"]
    for name in ("oscar_exact", "oscar_int2"):
        r = results[name]
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                 for a, b in zip(r["tokens"], base["tokens"])]
        summary[name] = {"sequences_equal_to_bf16": f"{same}/{len(base['tokens'])}",
                         "first_divergence": first, "kv_cache_size_tokens": r["kv_cache_size_tokens"]}
    summary["bf16"] = {"kv_cache_size_tokens": base["kv_cache_size_tokens"]}
    summary["exact_ok"] = results["oscar_exact"]["tokens"] == base["tokens"] and summary["ops"]["pages_identical_cpu_vs_cuda"]
    (OUT / "cuda_check.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    if not summary["exact_ok"]:
        raise SystemExit("CUDA check failed")


if __name__ == "__main__":
    main()
