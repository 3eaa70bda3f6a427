"""Accuracy of KV-cache variants through vLLM, in the decode regime.

Every variant runs in real vLLM on CPU with chunked prefill and
``max_num_batched_tokens = 64``, so each prompt token reads older context from
the cache as a generated token would. Writes
``benchmarks/results/accuracy-<model>.json`` and ``docs/accuracy.md`` (every
model's table).

    python -m benchmarks.accuracy                      # both house models' tables in docs/accuracy.md
    python -m benchmarks.accuracy --model examples/models/house-qwen2 --variants NAME ...
    python -m benchmarks.accuracy --render-only        # docs/accuracy.md from the saved JSON
    python -m benchmarks.accuracy --model M --label cuda --both-kernels --variants bf16 NAME ...
                                                       # on a GPU: each OSCAR row through the reference
                                                       # ops and through the Triton kernels, same weights

A model directory with a ``tokenizer/`` folder (house-qwen2) uses that tokenizer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from evalkit.data import (BUCKETS, REPO, needle_scores, needle_set, perplexity, ppl_windows, tokenizer,
                          tokenizer_path)
from evalkit.markdown import table

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


KERNEL_ROWS = {"reference ops": "reference", "Triton kernels": "triton"}
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


def score(llm, needles: list[dict], windows: list[list[int]], buckets: list = BUCKETS, wave_size: int = 16,
          guard_tokens: int = GUARD_TOKENS) -> dict:
    """Needle hits (overall and per length bucket) and perplexity of one engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    result = {}
    if needles:
        outs = generate_guarded(llm, [r["prompt"] for r in needles], SamplingParams(max_tokens=8, temperature=0),
                                wave_size, guard_tokens)
        scores = needle_scores([o.outputs[0].text for o in outs], needles, buckets)
        result.update(needle_acc=scores["needle_acc"], needle_by_bucket=scores["needle_by_bucket"],
                      needle_hits=scores["hits"], needles=len(needles))
    if windows:
        outs = generate_guarded(llm, [TokensPrompt(prompt_token_ids=w) for w in windows],
                                SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), wave_size, guard_tokens)
        result["ppl"], result["ppl_tokens"] = perplexity(outs, windows)
    return result


def evaluate(model: str, kvq: dict | None, needles: list[dict], windows: list[list[int]], args) -> dict:
    from vllm import LLM

    import torch

    # BF16 on the GPU: TRITON_ATTN, vLLM's kernel that runs on every card (the CUDA check's baseline too)
    kw = (dict(attention_backend="OSCAR", additional_config={"kvq": kvq}) if kvq is not None
          else dict(attention_backend="TRITON_ATTN") if torch.cuda.is_available() else {})
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
    result = {**score(llm, needles, windows), "seconds": time.time() - t0}
    llm.llm_engine.engine_core.shutdown()
    del llm
    return result


def model_table(results: dict, args) -> list[str]:
    base = results["bf16"]
    lines = [
        f"## `{Path(args.model).name}`" + (f" ({args.label}: {args.device}, weights `{args.model}`)" if getattr(args, "label", None) else ""),
        "",
        f"dtype {args.dtype}; {args.needles_per_bucket} needles per length bucket; {args.ppl_windows} perplexity "
        f"windows of 4000 tokens; prefill chunks of at most {args.chunk} tokens.",
        "",
    ]
    variant_rows, rows = variants(args.model), []
    variant_rows |= {f"{n}, {how}": kvq for n, kvq in variant_rows.items() for how in KERNEL_ROWS}
    for name, r in results.items():
        b = r["needle_by_bucket"]
        rel = r["needle_acc"] / base["needle_acc"] if base["needle_acc"] else float("nan")
        rows.append([f"unquantized KV ({args.dtype})" if name == "bf16" and args.dtype != "bfloat16" else name,
                     f"{bits_per_element(variant_rows.get(name)):.3f}", f"{r['needle_acc']:.3f}",
                     *(f"{b[k]:.2f}" for k in ("<1k", "1-2k", "2-3k", "3-4k")), f"{rel:.1%}", f"{r['ppl']:.3f}",
                     f"{r['ppl'] / base['ppl'] - 1:+.2%}"])
    header = ["variant", "bits/element", "needles", "<1k", "1-2k", "2-3k", "3-4k", "needles / bf16", "perplexity",
              "ppl vs bf16"]
    return lines + table(header, rows) + [""]


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


def kernel_findings(results: dict) -> list[str]:
    """Each variant run through both kernels: the two rows side by side."""
    bases = dict.fromkeys(name.rsplit(", ", 1)[0] for name in results)
    lines = [f"* **{base}**: " + "; ".join(f"{how} {_delta(results, f'{base}, {how}')}" for how in KERNEL_ROWS) + "."
             for base in bases if all(f"{base}, {how}" in results for how in KERNEL_ROWS)]
    return lines + [""] if lines else []


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
        "Regenerate both models' tables: `python -m benchmarks.accuracy` (one model: `--model "
        "examples/models/MODEL`; some rows: `--variants NAME ...`); the numbers below are from that "
        "command with its defaults, the calibration times from `python -m benchmarks.calibration_time`; "
        "`--render-only` rewrites this page from the saved results.",
        "",
    ]
    saved, labelled = {}, []
    for f in sorted((REPO / "benchmarks" / "results").glob("accuracy-*.json")):
        data = json.loads(f.read_text())
        if "bf16" not in data["results"]:
            continue
        if data["args"].get("label"):  # a run of its own (a GPU's): tables after the CPU ones
            labelled.append(data)
            continue
        lines += model_table(data["results"], argparse.Namespace(**data["args"]))
        saved[Path(data["args"]["model"]).name] = data["results"]
    for data in labelled:
        lines += model_table(data["results"], argparse.Namespace(**data["args"])) + kernel_findings(data["results"])
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
            "`python -m benchmarks.calibration_time` (CPU) and `python -m benchmarks.calibration_time "
            "--random-shape qwen3-8b --device cuda --dtype bfloat16 ...` (GPU: a random-weight model of "
            "Qwen3-8B's shape, written before the clock starts). The load average shows whether other "
            "jobs shared the CPUs. Targets: house-qwen3 under 2 minutes on CPU; Qwen3-8B shape at about "
            "30K tokens within 5 minutes on the H200.",
            "",
        ]
        header = ["model", "device", "dtype", "clip", "tokens", "wall time", "CPU time (user + sys)",
                  "load average before / after"]
        lines += table(header, [[r["model"], r.get("device", "CPU"), r.get("dtype", "float32"), r["clip"],
                                 f"{r['tokens']:,}", f"{r['wall_s']:.0f} s", f"{r.get('cpu_s', float('nan')):.0f} s",
                                 f"{r['load_before']} / {r.get('load_after', '?')}"]
                                for r in json.loads(timing.read_text())]) + [""]
    path.write_text("\n".join(lines) + "\n")


def run_model(args: argparse.Namespace) -> None:
    """Every variant of ``args.variants`` (default all) on one model; rows are
    merged into its saved JSON."""
    rows = variants(args.model)
    args.variants = args.variants or list(rows)
    if args.both_kernels:  # each OSCAR row twice: the PyTorch reference ops and the Triton kernels
        twins = {f"{name}, {how}": {**rows[name], "kernels": kernels}
                 for name in args.variants if rows[name] for how, kernels in KERNEL_ROWS.items()}
        args.variants = [n for n in args.variants if not rows[n]] + list(twins)
        rows |= twins
    suffix = f"-{args.label}" if args.label else ""
    import torch

    args.device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    args.json = str(REPO / "benchmarks" / "results" / f"accuracy-{Path(args.model).name}{suffix}.json")

    needles = needle_set(args.needles_per_bucket)
    windows = ppl_windows(tokenizer(args.model), args.ppl_windows)
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
    ap.add_argument("--label", default=None, help="results under accuracy-<model>-<label>.json, its own table "
                    "(e.g. cuda: the rows of one GPU run)")
    ap.add_argument("--both-kernels", action="store_true",
                    help="each OSCAR variant through the reference ops and through the Triton kernels")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from the saved JSON")
    args = ap.parse_args()
    if args.render_only:
        write_markdown(Path(args.markdown))
        return
    for model in args.model or [str(REPO / "examples" / "models" / m) for m in ("house-qwen3", "house-qwen2")]:
        tok = tokenizer_path(model)
        run_model(argparse.Namespace(**{**vars(args), "model": model, "tokenizer": tok if tok != model else None}))
    write_markdown(Path(args.markdown))
    print(Path(args.markdown).read_text())


if __name__ == "__main__":
    main()
