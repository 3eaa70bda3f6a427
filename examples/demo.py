"""What the OSCAR INT2 KV cache buys, on the bundled model.

    python examples/demo.py [--budget-mib 512] [--max-model-len 4096]

Runs the same long-context recall through BF16 and through OSCAR at the same
KV memory: files of held-out code of about 3,600 tokens with a few
``NAME = "VALUE"`` lines buried early on, ending in ``assert NAME == "``. The
answer must come from context read back from the cache as INT2 (the BF16 sink
and window hold only the first 64 and the last 256 tokens). Prints both
answers, how many such requests each cache holds (vLLM's own report at
``max_model_len``), and the measured accuracy from the benchmark's JSON.
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run by path: evalkit (the development data) and the accuracy benchmark's rows
NEEDLE_IDS = (95, 72)  # recall prompts with the needle 8% and 30% into a 3,650-token file


def run(model: str, kvq: dict | None, prompts: list[str], budget: int, max_len: int) -> tuple[list[str], float]:
    """Greedy answers and vLLM's reported concurrency at ``max_len`` tokens."""
    from vllm import LLM, SamplingParams

    kw = {"attention_backend": "OSCAR", "additional_config": {"kvq": kvq}} if kvq is not None else {}
    llm = LLM(model=model, max_model_len=max_len, kv_cache_memory_bytes=budget, enforce_eager=True,
              enable_prefix_caching=False, seed=0, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    requests = llm.llm_engine.vllm_config.cache_config.kv_cache_max_concurrency
    llm.llm_engine.engine_core.shutdown()
    return [o.outputs[0].text.split('"')[0] for o in outs], requests


def accuracy_line(model: str, kvq: dict) -> str:
    """The accuracy benchmark's row measured with these settings, if any."""
    from benchmarks.accuracy import variants

    path = REPO / "benchmarks" / "results" / f"accuracy-{Path(model).name}.json"
    names = [name for name, settings in variants(model).items() if settings == kvq]
    if not path.exists() or not names:
        return "No accuracy row was measured for these settings (benchmarks/accuracy.py)."
    rows = json.loads(path.read_text())["results"]
    base, row = rows["bf16"], rows[names[0]]
    return (f"Measured ({path.relative_to(REPO)}, docs/accuracy.md, row \"{names[0]}\"): needle recall "
            f"{row['needle_acc']:.2f} vs BF16 {base['needle_acc']:.2f} on {row['needles']} prompts, perplexity "
            f"{row['ppl']:.2f} vs {base['ppl']:.2f} ({row['ppl'] / base['ppl'] - 1:+.1%}) on "
            f"{row['ppl_tokens']:,} tokens of held-out code.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "examples" / "models" / "house-qwen3"))
    default_kvq = json.dumps({"artifact": str(REPO / "examples" / "artifacts" / "house-qwen3-oscar")})
    ap.add_argument("--kvq", default=default_kvq, help="OSCAR settings (JSON), default: the bundled artifact")
    ap.add_argument("--budget-mib", type=int, default=512, help="KV cache memory, the same for both")
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="tokens per request that capacity is counted at (the recall prompts need 3,700)")
    args = ap.parse_args()
    from evalkit.data import needles

    rows = {r["id"]: r for r in needles()}
    recalls = [rows[i] for i in NEEDLE_IDS]
    kvq = json.loads(args.kvq)
    t0 = time.time()
    bf16, bf16_requests = run(args.model, None, [r["prompt"] for r in recalls], args.budget_mib << 20,
                              args.max_model_len)
    oscar, oscar_requests = run(args.model, kvq, [r["prompt"] for r in recalls], args.budget_mib << 20,
                                args.max_model_len)

    print(f"\n{Path(args.model).name}, KV cache {args.budget_mib} MiB for each\n")
    for r, a, b in zip(recalls, bf16, oscar):
        name = r["prompt"].rstrip().splitlines()[-1].split()[1]
        print(f"Recall from a {r['prompt_tokens']:,}-token file, needle {r['depth']:.0%} in: "
              f'assert {name} == "{r["answer"]}"')
        for label, got in (("BF16 ", a), ("OSCAR", b)):
            print(f"  {label} answers \"{got}\"  {'right' if got == r['answer'] else 'WRONG'}")
    print(f"\nRequests of {args.max_model_len:,} tokens the KV cache holds at once (vLLM's report):")
    print(f"  BF16  {int(bf16_requests):>4}")
    print(f"  OSCAR {int(oscar_requests):>4}  ({oscar_requests / bf16_requests:.1f}x; every request also keeps its "
          "sink and window in BF16, so the ratio grows with request length)")
    print(f"\n{accuracy_line(args.model, kvq)}")
    print(f"\n({time.time() - t0:.0f} s for both engines)")


if __name__ == "__main__":
    main()
