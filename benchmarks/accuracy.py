"""Accuracy of KV-cache variants through vLLM, in the decode regime.

Every variant runs in real vLLM on CPU with chunked prefill and
``max_num_batched_tokens = 64``, so each prompt token reads older context from
the cache as a generated token would. Writes
``benchmarks/results/accuracy-<model>.json`` and ``docs/accuracy.md`` (every
model's table).

    python benchmarks/accuracy.py                      # both house models' tables in docs/accuracy.md
    python benchmarks/accuracy.py --model examples/models/house-qwen2 --variants NAME ...
    python benchmarks/accuracy.py --render-only        # docs/accuracy.md from the saved JSON

A model directory with a ``tokenizer/`` folder (house-qwen2) uses that tokenizer.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's vllm_kvq, also in vLLM's engine processes
SHARED = REPO.parent / "shared"
BUCKETS = [(0, 1024, "<1k"), (1024, 2048, "1-2k"), (2048, 3072, "2-3k"), (3072, 4097, "3-4k")]

def variants(model: str) -> dict[str, dict | None]:
    """The table's rows; OSCAR rows use ``examples/artifacts/<model>-oscar[-layer]``."""
    art = REPO / "examples" / "artifacts" / Path(model).name
    return {
        "bf16": None,
        "naive INT2 (no rotation, no sink/window)": {"rotation": "none", "sink": 0, "window": 0},
        "INT2 + sink/window": {"rotation": "none"},
        "Hadamard + sink/window": {"rotation": "hadamard"},
        "OSCAR, shared per-layer rotation": {"artifact": f"{art}-oscar-layer"},
        "OSCAR, per-KV-head rotation": {"artifact": f"{art}-oscar"},
        "OSCAR, per-KV-head rotation, exact value target": {"artifact": f"{art}-oscar-exact"},
        "OSCAR, per-KV-head rotation, fitted clip": {"artifact": f"{art}-oscar-fitted"},
        "KIVI-style INT2 + sink/window": {"scheme": "kivi"},
        "KIVI-style keys with int8 pairs + OSCAR values": {"scheme": "kivi", "key_pairs": "int8",
                                                           "artifact": f"{art}-oscar"},
        "OSCAR tiers: K 48x4 + 80x2, V 16x4 + 48x2 + 64 not stored": {"artifact": f"{art}-tiered"},
        "OSCAR tiers: K 32x4 + 96x2, V 16x4 + 32x2 + 80 not stored": {"artifact": f"{art}-tiered-2.25bit"},
        AUTO[80]: {"artifact": f"{art}-auto80"},
        AUTO[72]: {"artifact": f"{art}-auto72"},
    }


AUTO = {80: "OSCAR tiers chosen by calibration, 80 B (the default)", 72: "OSCAR tiers chosen by calibration, 72 B"}


def bits_per_element(kvq: dict | None, head_size: int = 128) -> float:
    """Bits per quantized element (codes + fp16 scales, K and V averaged);
    the BF16 sink and window are not counted."""
    if kvq is None:
        return 16.0
    from vllm_kvq.backends.resolve import page_format
    from vllm_kvq.backends.settings import OscarSettings

    fmt = page_format(head_size, 128, OscarSettings.from_dict(kvq))
    return 8.0 * fmt.bytes_per_token / (2 * head_size)


def needle_set(per_bucket: int, buckets: list = BUCKETS) -> list[dict]:
    """The first ``per_bucket`` dev needles of each prompt-length bucket."""
    rows = [json.loads(line) for line in (SHARED / "eval" / "needles-dev.jsonl").open()]
    chosen = []
    for lo, hi, _ in buckets:
        chosen += [r for r in rows if lo <= r["prompt_tokens"] < hi][:per_bucket]
    return chosen


def ppl_windows(tokenizer, count: int, length: int = 4000) -> list[list[int]]:
    text = gzip.open(SHARED / "eval" / "code-dev.txt.gz", "rt").read()
    ids = tokenizer(text[: 400 * length * count])["input_ids"]
    return [ids[i * length : (i + 1) * length] for i in range(count) if (i + 1) * length <= len(ids)]


GUARD_TOKENS = 4500


def generate_guarded(llm, prompts: list, params, wave_size: int = 16, guard_tokens: int = GUARD_TOKENS) -> list:
    """Generate in waves of requests, each beside a guard request longer than
    any prompt: vLLM lifts the per-request chunk cap when one request is left
    alone, so the guard keeps it until the wave is done."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    guard = TokensPrompt(prompt_token_ids=[(7 * i) % 8000 + 10 for i in range(guard_tokens)])
    results = []
    for i in range(0, len(prompts), wave_size):
        wave = prompts[i : i + wave_size]
        outs = llm.generate([guard, *wave], [SamplingParams(max_tokens=1)] + [params] * len(wave),
                            use_tqdm=False)
        results += outs[1:]
    return results


def evaluate(model: str, kvq: dict | None, needles: list[dict], windows: list[list[int]], args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(attention_backend="OSCAR", additional_config={"kvq": kvq}) if kvq is not None else {}
    if args.tokenizer:
        kw["tokenizer"] = args.tokenizer
    # Decode regime: every request is prefilled in chunks of at most
    # `args.chunk` tokens (vLLM's long_prefill_token_threshold), 16 requests
    # side by side. vLLM lifts that cap when a single request is left, so a
    # longer guard request runs alongside and is dropped from the results.
    llm = LLM(model=model, dtype=args.dtype, max_model_len=4600, max_num_seqs=17, enforce_eager=True,
              enable_chunked_prefill=True, max_num_batched_tokens=args.chunk * 17,
              long_prefill_token_threshold=args.chunk,
              enable_prefix_caching=False, kv_cache_memory_bytes=2 << 30, seed=0, **kw)
    t0 = time.time()
    outs = generate_guarded(llm, [r["prompt"] for r in needles], SamplingParams(max_tokens=8, temperature=0))
    hits = [o.outputs[0].text.startswith(r["answer"][:4]) for o, r in zip(outs, needles)]
    by_bucket = {}
    for lo, hi, name in BUCKETS:
        sel = [h for h, r in zip(hits, needles) if lo <= r["prompt_tokens"] < hi]
        by_bucket[name] = sum(sel) / len(sel) if sel else float("nan")
    ppl_out = generate_guarded(llm, [TokensPrompt(prompt_token_ids=w) for w in windows],
                               SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    nll, n = 0.0, 0
    for o, w in zip(ppl_out, windows):
        for i, entry in enumerate(o.prompt_logprobs[1:], start=1):
            nll -= entry[w[i]].logprob
            n += 1
    result = {"needle_acc": sum(hits) / len(hits), "needle_by_bucket": by_bucket,
              "ppl": math.exp(nll / n), "ppl_tokens": n, "needles": len(hits), "seconds": time.time() - t0}
    llm.llm_engine.engine_core.shutdown()
    del llm
    return result


def model_table(results: dict, args) -> list[str]:
    base = results["bf16"]
    lines = [
        f"## `{Path(args.model).name}`",
        "",
        f"dtype {args.dtype}; {args.needles_per_bucket} needles per length bucket; {args.ppl_windows} perplexity "
        f"windows of 4000 tokens; prefill chunks of at most {args.chunk} tokens.",
        "",
        "| variant | bits/element | needles | <1k | 1-2k | 2-3k | 3-4k | needles / bf16 | perplexity | ppl vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = variants(args.model)
    for name, r in results.items():
        bits = bits_per_element(rows.get(name))
        b = r["needle_by_bucket"]
        if name == "bf16" and args.dtype != "bfloat16":
            name = f"unquantized KV ({args.dtype})"
        rel = r["needle_acc"] / base["needle_acc"] if base["needle_acc"] else float("nan")
        lines.append(
            f"| {name} | {bits:.3f} | {r['needle_acc']:.3f} | {b['<1k']:.2f} | {b['1-2k']:.2f} | {b['2-3k']:.2f} | "
            f"{b['3-4k']:.2f} | {rel:.1%} | {r['ppl']:.3f} | {r['ppl'] / base['ppl'] - 1:+.2%} |"
        )
    return lines + [""]


def _delta(results: dict, name: str) -> str:
    """``+x.xx% perplexity, y% of BF16's needles`` of one row (rendered from the results)."""
    r, base = results[name], results["bf16"]
    return f"{r['ppl'] / base['ppl'] - 1:+.2%} perplexity, {r['needle_acc'] / base['needle_acc']:.0%} of BF16's needles"


def findings(saved: dict[str, dict]) -> list[str]:
    """The findings, their figures taken from the saved results of each model."""
    hand = "OSCAR tiers: K 48x4 + 80x2, V 16x4 + 48x2 + 64 not stored"
    lines = ["### Findings", ""]
    per = lambda name: "; ".join(f"{m} {_delta(r, name)}" for m, r in saved.items() if name in r)  # noqa: E731
    if all(AUTO[80] in r and hand in r for r in saved.values()):
        lines.append(f"* **The tiers calibration chooses** at the default 80 B per token and head (2.5 bits per "
                     f"element): {per(AUTO[80])}; the hand-picked plan of the same size: {per(hand)}. At OSCAR "
                     f"INT2's 72 B: {per(AUTO[72])}; OSCAR INT2 itself: {per('OSCAR, per-KV-head rotation')}.")
    lines += [
        "* **Fitted clip ratios do not help** (`fitted clip` rows: " + per("OSCAR, per-KV-head rotation, fitted clip")
        + "); the fixed 0.96 / 0.92 stay the default.",
        "* **Per-channel keys** (the KIVI-style reference point, 2.625 bits): " + per("KIVI-style INT2 + sink/window")
        + ".",
        "* Every row here is 24 needles and two 4,000-token windows: differences of a few tenths of a percent and "
        "a needle or two are within noise.",
        "",
    ]
    return lines


def write_markdown(path: Path) -> None:
    """docs/accuracy.md from every ``benchmarks/results/accuracy-*.json``."""
    lines = [
        "# Accuracy",
        "",
        "vLLM 0.32 CPU, decode regime: chunked prefill with every request prefilled in chunks of at most "
        "64 tokens (`long_prefill_token_threshold`), so every prompt token reads older context from the "
        "cache as a generated token would. Needles: the development needle set (200 prompts, 0.5K-4K "
        "tokens), the first N per length bucket, hit = greedy continuation starts with `answer[:4]`. "
        "Perplexity: windows of 4000 tokens of the held-out development code, from `prompt_logprobs`.",
        "",
        "Regenerate both models' tables: `python benchmarks/accuracy.py` (one model: `--model "
        "examples/models/MODEL`; some rows: `--variants NAME ...`); the numbers below are from that "
        "command with its defaults, the calibration times from `benchmarks/calibration_time.py`; "
        "`--render-only` rewrites this page from the saved results.",
        "",
    ]
    saved = {}
    for f in sorted((REPO / "benchmarks" / "results").glob("accuracy-*.json")):
        data = json.loads(f.read_text())
        if "bf16" in data["results"]:
            lines += model_table(data["results"], argparse.Namespace(**data["args"]))
            saved[Path(data["args"]["model"]).name] = data["results"]
    lines += [
        "Variants: `naive INT2` quantizes every key and value, the current token included (sink 0, "
        "window 0, no rotation, no clipping); `INT2 + sink/window` keeps the first 64 and last 256 "
        "tokens of every sequence in BF16; `Hadamard` rotates keys and values by a 128x128 "
        "Sylvester Hadamard matrix first. INT2 variants quantize each row as one group with an fp16 "
        "(scale, min). `OSCAR` rows use the artifacts in `examples/artifacts/` made by `vllm-kvq "
        "calibrate` on the development code (28,672 tokens; R = U·H·P_br from the grouped query "
        "covariance for K and the score-weighted value covariance for V, or the attention-output "
        "covariance V^T S^T S V for the `exact value target` row; clip 0.96 / 0.92, or `fitted clip`: "
        "`--clip fitted`, ratios per layer chosen on a held-out 2,048-token window by the "
        "attention-output error), shared per layer or per KV head (`--tiers int2`). `KIVI-style INT2` "
        "(`scheme: kivi`) quantizes keys per channel over groups of 32 positions and values per token, "
        "with no rotation and no clipping, and the same BF16 sink and window. `OSCAR tiers` rows cut "
        "each KV head's eigen-directions, strongest first, into tiers: INT4 (unclipped), INT2 (clip "
        "0.96 / 0.92) or not stored (read back as the calibrated mean), one fp16 (scale, min) per "
        "stored tier ([design.md](design.md)): by hand for every layer (`--tiers ...`, artifacts "
        "`-tiered` and `-tiered-2.25bit`), or chosen by calibration under a byte budget, one plan for "
        "every layer, from the error each candidate makes on the held-out window (the default `vllm-kvq "
        "calibrate`, artifacts `-auto80` and `-auto72` with `--bytes-per-token 72`).",
        "",
        "`bits/element`: bits per quantized element, codes plus fp16 scales, keys and values "
        "averaged (BF16 sink and window rows not counted; [design.md](design.md) gives the totals "
        "with them).",
        "",
        "`KIVI-style keys with int8 pairs + OSCAR values` (`scheme: kivi`, `key_pairs: int8`, the "
        "per-KV-head artifact): keys unrotated, per channel over 32 positions, each channel's "
        "(min, max) stored as int8 steps of one fp16 step per group and head (2.5 bits per key "
        "element); values rotated by the artifact's R_V, clipped at 0.92 and quantized per token "
        "(2.25 bits). 77 B per token and head, 2.406 bits per element.",
        "",
        *findings(saved),
    ]
    timing = REPO / "benchmarks" / "results" / "calibration-time.json"
    if timing.exists():
        lines += [
            "## Calibration time",
            "",
            "`vllm-kvq calibrate`, the whole command (process start to artifact written: imports, "
            "tokenization, checkpoint load, both capture passes, fitting), from "
            "`python benchmarks/calibration_time.py` (CPU) and `python benchmarks/calibration_time.py "
            "--random-shape qwen3-8b --device cuda --dtype bfloat16 ...` (GPU: a random-weight model of "
            "Qwen3-8B's shape, written before the clock starts). The load average shows whether other "
            "jobs shared the CPUs. Targets: house-qwen3 under 2 minutes on CPU; Qwen3-8B shape at about "
            "30K tokens within 5 minutes on the H200.",
            "",
            "| model | device | dtype | clip | tokens | wall time | CPU time (user + sys) | load average before / after |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in json.loads(timing.read_text()):
            lines.append(f"| {r['model']} | {r.get('device', 'CPU')} | {r.get('dtype', 'float32')} | {r['clip']} | "
                         f"{r['tokens']:,} | {r['wall_s']:.0f} s | {r.get('cpu_s', float('nan')):.0f} s | "
                         f"{r['load_before']} / {r.get('load_after', '?')} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def run_model(args: argparse.Namespace) -> None:
    """Every variant of ``args.variants`` (default all) on one model; rows are
    merged into its saved JSON."""
    rows = variants(args.model)
    args.variants = args.variants or list(rows)
    args.json = str(REPO / "benchmarks" / "results" / f"accuracy-{Path(args.model).name}.json")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    needles = needle_set(args.needles_per_bucket)
    windows = ppl_windows(tok, args.ppl_windows)
    saved = Path(args.json)
    # a subset of variants updates those rows and keeps the others
    results = json.loads(saved.read_text())["results"] if saved.exists() else {}
    for name in args.variants:
        result = evaluate(args.model, rows[name], needles, windows, args)
        print(f"{name}: {json.dumps(result)}", flush=True)
        # re-read: another run may have saved rows of the same model meanwhile
        results = json.loads(saved.read_text())["results"] if saved.exists() else results
        results[name] = result
        saved.write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="repeatable; default: house-qwen3 and house-qwen2")
    ap.add_argument("--dtype", default="float32", help="float32 runs 2x faster than bf16 on CPUs without bf16 units")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--needles-per-bucket", type=int, default=6)
    ap.add_argument("--ppl-windows", type=int, default=2)
    ap.add_argument("--variants", nargs="*", help="default: all rows of variants()")
    ap.add_argument("--markdown", default=str(REPO / "docs" / "accuracy.md"))
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from the saved JSON")
    args = ap.parse_args()
    if args.render_only:
        write_markdown(Path(args.markdown))
        return
    for model in args.model or [str(REPO / "examples" / "models" / m) for m in ("house-qwen3", "house-qwen2")]:
        tokenizer = Path(model) / "tokenizer"
        run_model(argparse.Namespace(**{**vars(args), "model": model,
                                        "tokenizer": str(tokenizer) if tokenizer.is_dir() else None}))
    write_markdown(Path(args.markdown))
    print(Path(args.markdown).read_text())


if __name__ == "__main__":
    main()
