"""Accuracy of GDN state pools through vLLM on house-qwen3next.

Every variant runs in real vLLM on CPU (bf16 weights, the GDN kernel's only
dtype; the reference keeps vLLM's FP32 states) with chunked prefill of at most
``--chunk`` tokens per request, so the packed state is refitted after every
chunk as it is after every decoded token, and the attention layers read the
same cache as in decode. ``--chunk 1`` refits after every token. Writes
``benchmarks/results/stepquant-accuracy[-chunkN].json`` and that chunk size's
table in ``docs/stepquant.md``.

    python benchmarks/stepquant_accuracy.py                 # chunk 64, all rows
    python benchmarks/stepquant_accuracy.py --chunk 1 --needles-per-bucket 0 \
        --ppl-windows 4 --ppl-length 1024 --variants ...    # every token refits
    python benchmarks/stepquant_accuracy.py --render-only [--chunk 1]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from accuracy import generate_guarded, needle_set, ppl_windows  # benchmarks/ is the script directory

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "house-qwen3next"
PLAN = REPO / "examples" / "artifacts" / "house-qwen3next-stepquant"
OSCAR = REPO / "examples" / "artifacts" / "house-qwen3next-oscar"
BUCKETS = [(0, 1024, "<1k"), (1024, 2048, "1-2k")]
MAX_LEN = 2200
GUARD = MAX_LEN - 8  # the guard request: longer than any prompt, inside the model's context


def variants() -> dict[str, tuple[dict | None, bool]]:
    """Row name -> (kvq settings or None for FP32 states, OSCAR attention)."""
    sq = {"state": "stepquant", "state_artifact": str(PLAN)}
    return {
        "FP32 state (vLLM)": (None, False),
        "FP16 pool": ({"state": "uniform", "state_bits": 16}, False),
        "uniform INT8, rowwise absmax": ({"state": "uniform", "state_bits": 8}, False),
        "uniform INT6, rowwise absmax": ({"state": "uniform", "state_bits": 6}, False),
        "STEPQuant @6": ({**sq, "state_bits": 6}, False),
        "uniform INT4, rowwise absmax": ({"state": "uniform", "state_bits": 4}, False),
        "STEPQuant @4": ({**sq, "state_bits": 4}, False),
        "STEPQuant @6 + OSCAR INT2 attention": ({**sq, "state_bits": 6, "artifact": str(OSCAR)}, True),
    }


def evaluate(kvq: dict | None, oscar: bool, needles: list[dict], windows: list[list[int]], args) -> dict:
    import os

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    kw = {"additional_config": {"kvq": kvq}} if kvq else {}
    if oscar:
        kw["attention_backend"] = "OSCAR"
    wave = args.wave
    llm = LLM(model=str(MODEL), dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=MAX_LEN,
              max_num_seqs=wave + 1, enforce_eager=True, enable_chunked_prefill=True,
              max_num_batched_tokens=max(args.chunk * (wave + 1), 64), long_prefill_token_threshold=args.chunk,
              enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30, seed=0, **kw)
    t0 = time.time()
    from evalkit.probe import allocated_state_bytes

    pool = sum(layer["page_bytes"] for layer in llm.apply_model(allocated_state_bytes)[0])
    result = {"state_bytes_per_request": pool}
    if needles:
        outs = generate_guarded(llm, [r["prompt"] for r in needles], SamplingParams(max_tokens=8, temperature=0),
                                wave, GUARD)
        hits = [o.outputs[0].text.startswith(r["answer"][:4]) for o, r in zip(outs, needles)]
        result["needle_acc"] = sum(hits) / len(hits)
        result["needles"] = len(hits)
        result["needle_hits"] = hits
        result["needle_by_bucket"] = {
            name: (lambda sel: sum(sel) / len(sel) if sel else float("nan"))(
                [h for h, r in zip(hits, needles) if lo <= r["prompt_tokens"] < hi])
            for lo, hi, name in BUCKETS}
    if windows:
        outs = generate_guarded(llm, [TokensPrompt(prompt_token_ids=w) for w in windows],
                                SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), wave, GUARD)
        nll, n = 0.0, 0
        for o, w in zip(outs, windows):
            for i, entry in enumerate(o.prompt_logprobs[1:], start=1):
                nll -= entry[w[i]].logprob
                n += 1
        result["ppl"] = math.exp(nll / n)
        result["ppl_tokens"] = n
    result["seconds"] = time.time() - t0
    llm.llm_engine.engine_core.shutdown()
    del llm
    return result


def table(saved: dict) -> list[str]:
    args, results = saved["args"], saved["results"]
    ref = results.get("FP32 state (vLLM)", {})
    lines = [f"Prefill chunks of at most {args['chunk']} tokens; {args['needles_per_bucket']} needles per length bucket "
             f"(<1k, 1-2k tokens); {args['ppl_windows']} perplexity windows of {args['ppl_length']} tokens.", "",
             "| state pool | bytes per request (6 GDN layers) | vs FP32 | needles | <1k | 1-2k | needles / FP32 | perplexity | ppl vs FP32 |",
             "|---|---:|---:|---|---|---|---|---|---|"]
    for name, r in results.items():
        row = [name, f"{r['state_bytes_per_request']:,}",
               f"{ref['state_bytes_per_request'] / r['state_bytes_per_request']:.2f}x" if ref else ""]
        if "needle_acc" in r:
            row += [f"{r['needle_acc']:.3f}", *(f"{v:.2f}" for v in r["needle_by_bucket"].values()),
                    f"{100 * r['needle_acc'] / ref['needle_acc']:.1f}%" if ref.get("needle_acc") else ""]
        else:
            row += ["", "", "", ""]
        row += [f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / ref['ppl'] - 1):+.2f}%"] if "ppl" in r else ["", ""]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def render(path: Path, results_json: Path) -> None:
    saved = json.loads(results_json.read_text())
    text = path.read_text() if path.exists() else ""
    tag = f"chunk{saved['args']['chunk']}"
    start, end = f"<!-- accuracy:{tag}:begin -->", f"<!-- accuracy:{tag}:end -->"
    block = "\n".join([start, *table(saved), end])
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text += "\n" + block + "\n"
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--wave", type=int, default=16, help="requests side by side")
    ap.add_argument("--needles-per-bucket", type=int, default=40)
    ap.add_argument("--ppl-windows", type=int, default=8)
    ap.add_argument("--ppl-length", type=int, default=2048)
    ap.add_argument("--variants", nargs="*", help="default: all rows of variants()")
    ap.add_argument("--json", help="default: benchmarks/results/stepquant-accuracy[-chunkN].json")
    ap.add_argument("--markdown", default=str(REPO / "docs" / "stepquant.md"))
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    suffix = "" if args.chunk == 64 else f"-chunk{args.chunk}"
    out = Path(args.json or REPO / "benchmarks" / "results" / f"stepquant-accuracy{suffix}.json")
    if not args.render_only:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(MODEL))
        needles = needle_set(args.needles_per_bucket, BUCKETS)
        windows = ppl_windows(tok, args.ppl_windows, args.ppl_length)
        saved = json.loads(out.read_text()) if out.exists() else {"results": {}}
        if saved.get("args", {}).get("chunk") not in (None, args.chunk):
            saved = {"results": {}}
        saved["args"] = {k: v for k, v in vars(args).items() if k in
                         ("chunk", "wave", "needles_per_bucket", "ppl_windows", "ppl_length")}
        for name, (kvq, oscar) in variants().items():
            if args.variants and name not in args.variants:
                continue
            r = evaluate(kvq, oscar, needles, windows, args)
            saved["results"][name] = r
            print(f"{name}: needles {r.get('needle_acc', float('nan')):.3f} ppl {r.get('ppl', float('nan')):.3f} "
                  f"state {r['state_bytes_per_request']:,} B ({r['seconds']:.0f} s)", flush=True)
            out.write_text(json.dumps(saved, indent=1) + "\n")
    render(Path(args.markdown), out)
    print("\n".join(table(json.loads(out.read_text()))))


if __name__ == "__main__":
    main()
