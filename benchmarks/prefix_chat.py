"""Multi-turn chat over one shared document, with prefix caching, in real vLLM.

The chat job: C conversations of T turns each. Every conversation starts
with the same D-token document and its own U-token question; each turn
resends the whole conversation (document, questions, answers so far) plus a
new question, and the next turn is submitted when the answer (G tokens) is
done, all conversations at once (a closed loop). Three engines at the same
KV-cache memory: OSCAR with prefix caching, OSCAR without, and the unquantized
cache (TRITON_ATTN on CUDA, CPU_ATTN on CPU) with prefix caching. Reported:
prompt tokens that hit the cache, TTFT p50/p95 (submission to first token,
queueing included), generated and total tokens/s over the job's wall time.

The ngram job: the same prompts (held-out code, which prompt lookup can copy
from) decoded with and without ngram speculation, OSCAR and the unquantized
cache: decode tokens/s (generated tokens over the steps without a prefill)
and the acceptance rate.

Each engine runs in its own process with the engine core in it (``run``
sub-command); the parent writes ``benchmarks/results/prefix_chat.json`` (or
``$OUT``) under a label and prints tables.

    python benchmarks/prefix_chat.py                  # H200: 32 x 6 over 16K tokens, Qwen3-4B shape
    python benchmarks/prefix_chat.py --small          # CPU: house-qwen3, 8 x 4 over 1K tokens
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oscar_vllm_e2e import QWEN3_4B  # noqa: E402
from serving_job import run_child  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HOUSE = REPO / "examples" / "models" / "house-qwen3"
HOUSE_ARTIFACT = REPO / "examples" / "artifacts" / "house-qwen3-oscar"
EVAL = REPO.parent / "shared" / "eval"
CHAT_ENGINES = ("oscar_apc", "oscar_no_apc", "bf16_apc")
NGRAM_ENGINES = ("oscar_plain", "oscar_ngram", "bf16_plain", "bf16_ngram")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _code_token_ids(count: int, min_tokens: int) -> list[list[int]]:
    """Token ids of held-out code files (real text for the house model)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(HOUSE))
    rows = [json.loads(line) for line in (EVAL / "needles-dev.jsonl").open()]
    rows = [r for r in rows if r["prompt_tokens"] >= min_tokens][:count]
    return [tok(r["prompt"])["input_ids"] for r in rows]


def _engine(name: str, args: argparse.Namespace):
    """One engine of the job: ``oscar_*`` or ``bf16_*``, APC or ngram as named.
    The ngram engines always serve the house model (prompt lookup needs real
    weights to accept anything)."""
    import torch

    import vllm_kvq

    vllm_kvq.register()
    from vllm import LLM

    cuda = torch.cuda.is_available()
    kw = dict(seed=0, enforce_eager=True, async_scheduling=False, max_model_len=args.max_model_len,
              enable_prefix_caching=name in ("oscar_apc", "bf16_apc"), disable_log_stats=False,
              max_num_batched_tokens=args.chunk, max_num_seqs=args.max_seqs)
    house = args.model == "house" or name in NGRAM_ENGINES
    if name.startswith("oscar"):
        artifact = {"artifact": str(HOUSE_ARTIFACT)} if house else {"rotation": "hadamard"}
        kw.update(attention_backend="OSCAR", additional_config={"kvq": artifact})
    else:
        kw.update(attention_backend="TRITON_ATTN" if cuda else "CPU_ATTN")
    if name.endswith("_ngram"):
        kw.update(speculative_config=dict(NGRAM))
    if cuda:
        kw.update(gpu_memory_utilization=args.gpu_mem)
    else:
        kw.update(kv_cache_memory_bytes=args.kv_bytes)
    if house:
        return LLM(model=str(HOUSE), **kw)
    model = Path(args.model_dir)
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_4B))
    return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, **kw)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def chat_job(llm, args: argparse.Namespace) -> dict:
    """The closed-loop chat job, stepped in this process."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if args.model == "house":
        code = _code_token_ids(args.conversations + 1, args.doc_len)
        doc = code[0][: args.doc_len]
        questions = [[ids[args.user_len * t: args.user_len * (t + 1)] for t in range(args.turns)] for ids in code[1:]]
    else:
        gen = torch.Generator().manual_seed(0)
        randint = lambda n: torch.randint(0, QWEN3_4B["vocab_size"], (n,), generator=gen).tolist()  # noqa: E731
        doc = randint(args.doc_len)
        questions = [[randint(args.user_len) for _ in range(args.turns)] for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True, detokenize=False)
    engine = llm.llm_engine
    history = {c: doc + questions[c][0] for c in range(args.conversations)}
    submitted, first_token, records = {}, {}, []
    start = time.perf_counter()

    def submit(c: int, turn: int) -> None:
        req = f"c{c}-t{turn}"
        submitted[req] = time.perf_counter()
        engine.add_request(req, TokensPrompt(prompt_token_ids=list(history[c])), params)

    for c in range(args.conversations):
        submit(c, 0)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id not in first_token and out.outputs and out.outputs[0].token_ids:
                first_token[out.request_id] = now
            if not out.finished:
                continue
            c, turn = (int(x[1:]) for x in out.request_id.split("-"))
            records.append({"turn": turn, "prompt": len(out.prompt_token_ids), "cached": out.num_cached_tokens or 0,
                            "generated": len(out.outputs[0].token_ids),
                            "ttft_s": first_token[out.request_id] - submitted[out.request_id]})
            if turn + 1 < args.turns:
                history[c] = history[c] + list(out.outputs[0].token_ids) + questions[c][turn + 1]
                submit(c, turn + 1)
    wall = time.perf_counter() - start
    prompt = sum(r["prompt"] for r in records)
    generated = sum(r["generated"] for r in records)
    later = [r for r in records if r["turn"] > 0]
    ttft = [r["ttft_s"] for r in records]
    return {"requests": len(records), "prompt_tokens": prompt, "generated_tokens": generated,
            "hit_rate": sum(r["cached"] for r in records) / prompt,
            "hit_rate_after_turn_1": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
            "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p95_s": _percentile(ttft, 0.95),
            "job_wall_s": wall, "generated_tokens_per_s": generated / wall,
            "total_tokens_per_s": (prompt + generated) / wall}


def ngram_job(llm, args: argparse.Namespace) -> dict:
    """All prompts at once; decode tokens/s over the steps without a prefill."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [ids[: args.ngram_prompt_len] for ids in _code_token_ids(args.ngram_requests, args.ngram_prompt_len)]
    params = SamplingParams(max_tokens=args.ngram_gen, temperature=0, detokenize=False)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    for i, ids in enumerate(prompts):
        engine.add_request(f"n{i}", TokensPrompt(prompt_token_ids=ids), params)
    produced: dict[str, int] = {}
    decode_s = decode_tokens = 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        decoding = not scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                                  for r in scheduler.running)
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        new = 0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            new += n - produced.get(out.request_id, 0)
            produced[out.request_id] = n
        if decoding:
            decode_s += dt
            decode_tokens += new
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens") or 0
    return {"requests": len(prompts), "generated_tokens": sum(produced.values()),
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
            "job_wall_s": time.perf_counter() - start,
            "acceptance_rate": metrics["vllm:spec_decode_num_accepted_tokens"] / drafted if drafted else None}


def run(name: str, args: argparse.Namespace) -> dict:
    llm = _engine(name, args)
    capacity = llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
    job = chat_job(llm, args) if name in CHAT_ENGINES else ngram_job(llm, args)
    return {"engine": name, "kv_cache_size_tokens": capacity, **job}


SMALL = dict(model="house", conversations=8, turns=4, doc_len=1024, user_len=32, gen=32, max_model_len=2048,
             chunk=64, max_seqs=16, kv_bytes=48 << 20, ngram_requests=8, ngram_prompt_len=768, ngram_gen=64)
H200 = dict(model="dummy", conversations=32, turns=6, doc_len=16384, user_len=128, gen=256, max_model_len=20480,
            chunk=8192, max_seqs=64, ngram_requests=32, ngram_prompt_len=1024, ngram_gen=256)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="all", choices=["all", "run", "render"])
    p.add_argument("--engine", choices=CHAT_ENGINES + NGRAM_ENGINES)
    p.add_argument("--small", action="store_true", help="the CPU job (house-qwen3, 8 x 4 over 1K tokens)")
    p.add_argument("--label", default=None, help="key of this run in the JSON (default: cpu-small / h200)")
    p.add_argument("--gpu-mem", type=float, default=0.5)
    p.add_argument("--model-dir", default="/tmp/kvq_qwen3_4b_dummy")
    p.add_argument("--json", default=None)
    p.add_argument("--timeout-s", type=float, default=None, help="time limit of each engine's run")
    for key, value in H200.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    p.add_argument("--kv-bytes", type=int, default=None)
    args = p.parse_args()
    for key, value in (SMALL if args.small else H200).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    out = Path(args.json or (Path(os.environ["OUT"]) / "prefix_chat.json" if "OUT" in os.environ
                             else Path(__file__).parent / "results" / "prefix_chat.json"))
    if args.mode == "run":
        print("RESULT " + json.dumps(run(args.engine, args)), flush=True)
        return
    if args.mode == "all":
        shape = {k: getattr(args, k) for k in SMALL if getattr(args, k, None) is not None}
        job = {"platform": "CPU (vLLM CPU build, 2 cores shared)" if args.small else "CUDA", **shape,
               "gpu_memory_utilization": None if args.small else args.gpu_mem, "ngram": NGRAM}
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if args.small:  # numba's ngram threads otherwise fight torch's for the cores (5-20x slower steps)
            env.setdefault("NUMBA_NUM_THREADS", "1")
        job["numba_num_threads"] = env.get("NUMBA_NUM_THREADS")
        passed = [a for a in sys.argv[1:] if a not in ("all",)]
        for name in CHAT_ENGINES + NGRAM_ENGINES:
            job[name] = run_child([sys.executable, __file__, "run", "--engine", name, *passed], env, args.timeout_s)
            print(name, job[name], flush=True)
        results = json.loads(out.read_text()) if out.exists() else {}
        results[args.label or ("cpu-small" if args.small else "h200")] = job
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
    print(render(json.loads(out.read_text())))


def render(results: dict) -> str:
    rows = []
    for label, job in results.items():
        rows += [f"### {label}: {job['conversations']} conversations x {job['turns']} turns over a "
                 f"{job['doc_len']}-token document ({job['platform']}, model {job['model']})", "",
                 "| engine | KV capacity (tokens) | hit rate (turns 2+) | TTFT p50 / p95 (s) | generated tok/s | "
                 "total tok/s |", "|---|---:|---:|---:|---:|---:|"]
        for name in CHAT_ENGINES:
            r = job.get(name, {})
            if "error" in r or not r:
                rows.append(f"| {name} | failed | | | | |")
                continue
            rows.append(f"| {name} | {r['kv_cache_size_tokens']:,} | {r['hit_rate']:.1%} "
                        f"({r['hit_rate_after_turn_1']:.1%}) | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | "
                        f"{r['generated_tokens_per_s']:,.1f} | {r['total_tokens_per_s']:,.1f} |")
        rows += ["", "| engine | decode tok/s | ngram acceptance |", "|---|---:|---:|"]
        for name in NGRAM_ENGINES:
            r = job.get(name, {})
            if "error" in r or not r:
                rows.append(f"| {name} | failed: {r.get('error', '')[-120:]!r} | |")
                continue
            rate = r.get("acceptance_rate")
            rows.append(f"| {name} | {r['decode_tokens_per_s']:,.1f} | {f'{rate:.1%}' if rate else '-'} |")
        rows.append("")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
