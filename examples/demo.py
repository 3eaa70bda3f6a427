"""Generate with the OSCAR INT2 KV cache next to BF16 on a bundled model.

    python examples/demo.py [--model examples/models/house-qwen3] [--kvq '{"artifact": "..."}']

Prints each backend's KV capacity (tokens vLLM reports at the same memory
budget) and sample completions.
"""

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "import numpy as np\n\n\ndef moving_average(x, n):\n",
    "class Stack:\n    def __init__(self):\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def run(model: str, kvq: dict | None, budget: int, max_len: int):
    from vllm import LLM, SamplingParams

    kw = {"attention_backend": "OSCAR", "additional_config": {"kvq": kvq}} if kvq is not None else {}
    llm = LLM(model=model, max_model_len=max_len, kv_cache_memory_bytes=budget, enforce_eager=True,
              enable_prefix_caching=False, seed=0, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
    capacity = llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
    llm.llm_engine.engine_core.shutdown()
    return capacity, [o.outputs[0].text for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "examples" / "models" / "house-qwen3"))
    default_kvq = json.dumps({"artifact": str(REPO / "examples" / "artifacts" / "house-qwen3-oscar")})
    ap.add_argument("--kvq", default=default_kvq, help="OSCAR settings (JSON), default: the bundled artifact")
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=16384)
    args = ap.parse_args()
    budget = args.budget_mib << 20
    results = {
        "BF16": run(args.model, None, budget, args.max_model_len),
        "OSCAR": run(args.model, json.loads(args.kvq), budget, args.max_model_len),
    }
    base = results["BF16"][0]
    print(f"\nKV cache budget {args.budget_mib} MiB, max_model_len {args.max_model_len}")
    for name, (cap, texts) in results.items():
        print(f"\n== {name}: KV capacity {cap:,} tokens ({cap / base:.2f}x BF16)")
        for p, t in zip(PROMPTS, texts):
            print(f"--- {p!r}\n{t}")


if __name__ == "__main__":
    main()
