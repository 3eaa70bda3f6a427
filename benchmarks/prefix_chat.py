"""Multi-turn chat over one shared document with prefix caching, and decoding
with speculation, OSCAR against the unquantized cache in real vLLM.

The chat job: C conversations of T turns each. Every conversation starts
with the same D-token document and its own U-token question; each turn
resends the whole conversation (document, questions, answers so far) plus a
new question, and the next turn is submitted when the answer (G tokens) is
done, all conversations at once (a closed loop). Three engines at the same
KV-cache memory: OSCAR with prefix caching, OSCAR without, and the unquantized
cache (TRITON_ATTN on CUDA, CPU_ATTN on CPU) with prefix caching. Reported:
prompt tokens that hit the cache, TTFT p50/p95 (submission to first token,
queueing included), generated and total tokens/s over the job's wall time.
With ``--budget-s`` no turn is submitted after that many seconds and what
still runs 30 s later is aborted; such a job reports the requests it
finished (``complete: false``).

The speculation job: R requests decoded with and without speculation, OSCAR
and the unquantized cache: decode tokens/s (generated tokens over the steps
without a prefill) and the acceptance rate. ngram (prompt lookup) on every
platform; on CUDA also EAGLE-3, with a one-layer draft head of random
weights made on the machine (no trained head is at hand, so nearly nothing
is accepted: its row is the cost of drafting and verifying k tokens a step).
The draft's own layer keeps vLLM's BF16 cache (TRITON_ATTN) in the same
block pool, beside OSCAR blocks sized to a whole number of its pages: the KV
capacity column shows what the draft's layer costs.

``--small`` runs house-qwen3 on CPU (real weights, real code as prompts);
otherwise a random-weight Qwen3-4B-shaped model (``load_format="dummy"``)
with token-id prompts: random documents and questions for the chat job,
random prompts for the speculation job, whose greedy continuations repeat
soon, which prompt lookup copies.

Each engine runs in its own process (``run`` sub-command); the parent
merges its figures into ``benchmarks/results/prefix_chat.json`` (or
``$OUT``) under a label. ``render`` writes docs/prefix_caching.md from the
JSON (``--doc``) and prints it; ``merge FILE...`` first adds the engines of
other runs' JSON files (the H200 steps' copies) to it, or with ``--label`` files
one run whole as its own section.

    python -m benchmarks.prefix_chat --jobs chat --budget-s 70    # H200: 32 x 6 over 16K tokens
    python -m benchmarks.prefix_chat --jobs spec                  # H200: ngram against none
    python -m benchmarks.prefix_chat --jobs eagle --label gpu-eagle3  # H200: EAGLE-3 against none
    python -m benchmarks.prefix_chat --small                      # CPU: house-qwen3, 8 x 4 over 1K tokens
    python -m benchmarks.prefix_chat render --doc docs/prefix_caching.md
    python -m benchmarks.prefix_chat merge h200/prefix_chat.json --doc docs/prefix_caching.md
    python -m benchmarks.prefix_chat merge h200/eagle.json --label gpu-eagle3 --doc docs/prefix_caching.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.oscar_vllm_e2e import QWEN3_4B
from benchmarks.serving_job import GRAPHS, run_child
from evalkit.data import REPO, model_path, needles, tokenizer

HOUSE = Path(model_path("house-qwen3"))
HOUSE_ARTIFACT = REPO / "examples" / "artifacts" / "house-qwen3-oscar"
RESULTS = Path(__file__).parent / "results" / "prefix_chat.json"
DOC = REPO / "docs" / "prefix_caching.md"
CHAT_ENGINES = ("oscar_apc", "oscar_no_apc", "bf16_apc")
SPEC_ENGINES = ("oscar_plain", "oscar_ngram", "oscar_eagle3", "bf16_plain", "bf16_ngram", "bf16_eagle3")
JOBS = {"chat": CHAT_ENGINES, "spec": ("oscar_plain", "oscar_ngram", "bf16_plain", "bf16_ngram"),
        "eagle": ("oscar_plain", "oscar_eagle3", "bf16_plain", "bf16_eagle3")}
DRAIN_S = 30
"""With ``--budget-s``: requests still running this long after the budget are
aborted, so that a cut job ends in bounded time."""
DRAFTS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
EAGLE3 = {"method": "eagle3", "num_speculative_tokens": DRAFTS}


def _code_token_ids(count: int, min_tokens: int) -> list[list[int]]:
    """Token ids of held-out code files (real text for the house model)."""
    tok = tokenizer("house-qwen3")
    return [tok(r["prompt"])["input_ids"] for r in needles(max_tokens=10**9, min_tokens=min_tokens, limit=count)]


def _random_model(args: argparse.Namespace) -> Path:
    model = Path(args.model_dir)
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_4B))
    return model


def _eagle3_head(target: dict, where: Path) -> str:
    """A one-layer EAGLE-3 draft head for ``target``'s shape (random weights:
    the engine loads it with the target's ``load_format="dummy"``), reading
    the target's hidden states of three distinct layers (vLLM's default
    choice where the model is deep enough)."""
    layers = target["num_hidden_layers"]
    config = {**target, "architectures": ["Eagle3Qwen3ForCausalLM"], "num_hidden_layers": 1,
              "eagle_aux_hidden_state_layer_ids": [2, layers // 2, layers - 3] if layers >= 8 else [1, 2, 3]}
    config.pop("layer_types", None)
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(config))
    return str(where)


def _engine(name: str, args: argparse.Namespace):
    """One engine: ``oscar_*`` or ``bf16_*``, prefix caching or speculation
    as named."""
    import torch

    import vllm_kvq

    vllm_kvq.register()
    from vllm import LLM

    cuda = torch.cuda.is_available()
    kw = dict(seed=0, async_scheduling=False, max_model_len=args.max_model_len,
              enable_prefix_caching=name in ("oscar_apc", "bf16_apc"), disable_log_stats=False,
              max_num_batched_tokens=args.chunk, max_num_seqs=args.max_seqs)
    kw.update(dict(enforce_eager=False, compilation_config=dict(GRAPHS)) if args.cuda_graphs
              else dict(enforce_eager=True))
    house = args.model == "house"
    bf16 = "TRITON_ATTN" if cuda else "CPU_ATTN"
    if name.startswith("oscar"):
        kw.update(attention_backend="OSCAR", additional_config={
            "kvq": {"artifact": str(HOUSE_ARTIFACT)} if house else {"rotation": "hadamard"}})
    else:
        kw.update(attention_backend=bf16)
    model = HOUSE if house else _random_model(args)
    if name.endswith("_ngram"):
        kw.update(speculative_config=dict(NGRAM))
    elif name.endswith("_eagle3"):
        config = json.loads((model / "config.json").read_text())
        kw.update(speculative_config=dict(EAGLE3, model=_eagle3_head(config, Path(args.model_dir) / "eagle3-head"),
                                          attention_backend=bf16))
    chat = name in CHAT_ENGINES
    if cuda:
        kw.update(gpu_memory_utilization=args.gpu_mem if chat else args.spec_gpu_mem)
    else:
        kw.update(kv_cache_memory_bytes=args.kv_bytes)
    if house:
        return LLM(model=str(model), **kw)
    return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, **kw)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _random_ids(count: int, n: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, QWEN3_4B["vocab_size"], (n,), generator=gen).tolist() for _ in range(count)]


def chat_job(llm, args: argparse.Namespace) -> dict:
    """The closed-loop chat job, stepped in this process."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if args.model == "house":
        code = _code_token_ids(args.conversations + 1, args.doc_len)
        doc = code[0][: args.doc_len]
        questions = [[ids[args.user_len * t: args.user_len * (t + 1)] for t in range(args.turns)] for ids in code[1:]]
    else:
        doc = _random_ids(1, args.doc_len, 0)[0]
        asked = _random_ids(args.conversations * args.turns, args.user_len, 1)
        questions = [asked[c * args.turns:(c + 1) * args.turns] for c in range(args.conversations)]
    params = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True, detokenize=False)
    engine = llm.llm_engine
    history = {c: doc + questions[c][0] for c in range(args.conversations)}
    submitted, first_token, records, finished = {}, {}, [], set()
    start = time.perf_counter()

    def submit(c: int, turn: int) -> None:
        req = f"c{c}-t{turn}"
        submitted[req] = time.perf_counter()
        engine.add_request(req, TokensPrompt(prompt_token_ids=list(history[c])), params)

    for c in range(args.conversations):
        submit(c, 0)
    cut = False
    while engine.has_unfinished_requests():
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s + DRAIN_S:
            engine.abort_request([r for r in submitted if r not in finished])
            break
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id not in first_token and out.outputs and out.outputs[0].token_ids:
                first_token[out.request_id] = now
            if not out.finished:
                continue
            finished.add(out.request_id)
            c, turn = (int(x[1:]) for x in out.request_id.split("-"))
            records.append({"turn": turn, "prompt": len(out.prompt_token_ids), "cached": out.num_cached_tokens or 0,
                            "generated": len(out.outputs[0].token_ids),
                            "ttft_s": first_token[out.request_id] - submitted[out.request_id]})
            cut = cut or (args.budget_s is not None and now - start > args.budget_s)
            if turn + 1 < args.turns and not cut:
                history[c] = history[c] + list(out.outputs[0].token_ids) + questions[c][turn + 1]
                submit(c, turn + 1)
    wall = time.perf_counter() - start
    prompt = sum(r["prompt"] for r in records)
    generated = sum(r["generated"] for r in records)
    later = [r for r in records if r["turn"] > 0]
    ttft = [r["ttft_s"] for r in records]
    return {"requests": len(records), "complete": len(records) == args.conversations * args.turns,
            "prompt_tokens": prompt, "generated_tokens": generated,
            "hit_rate": sum(r["cached"] for r in records) / prompt,
            "hit_rate_after_turn_1": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
            "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p95_s": _percentile(ttft, 0.95),
            "job_wall_s": wall, "generated_tokens_per_s": generated / wall,
            "total_tokens_per_s": (prompt + generated) / wall}


def spec_job(llm, args: argparse.Namespace) -> dict:
    """All prompts at once; decode tokens/s over the steps without a prefill."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if args.model == "house":
        prompts = [ids[: args.spec_prompt_len]
                   for ids in _code_token_ids(args.spec_requests, args.spec_prompt_len)]
    else:
        prompts = _random_ids(args.spec_requests, args.spec_prompt_len, 2)
    params = SamplingParams(max_tokens=args.spec_gen, temperature=0, ignore_eos=True, detokenize=False)
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
    job = chat_job(llm, args) if name in CHAT_ENGINES else spec_job(llm, args)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"engine": name, "device": device, "kv_cache_size_tokens": capacity, **job}


SMALL = dict(model="house", conversations=8, turns=4, doc_len=1024, user_len=32, gen=32, max_model_len=2048,
             chunk=64, max_seqs=16, kv_bytes=48 << 20, spec_requests=8, spec_prompt_len=768, spec_gen=64)
H200 = dict(model="dummy", conversations=32, turns=6, doc_len=16384, user_len=128, gen=128, max_model_len=20480,
            chunk=8192, max_seqs=64, gpu_mem=0.15, spec_gpu_mem=0.5, spec_requests=32, spec_prompt_len=2048,
            spec_gen=256)
"""The H200 shapes: at gpu_memory_utilization 0.15 the unquantized cache holds
the document and a few conversations, OSCAR's all 32 (the chat job); the
speculation job runs with room for every request in both caches."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="all", choices=["all", "run", "render", "merge"])
    p.add_argument("files", nargs="*", help="merge: JSON files whose labels' engines are added")
    p.add_argument("--engine", choices=CHAT_ENGINES + SPEC_ENGINES, help="the engine of one 'run'")
    p.add_argument("--jobs", nargs="+", choices=sorted(JOBS) + list(CHAT_ENGINES + SPEC_ENGINES), default=None,
                   help="the jobs or single engines of 'all' (default: all jobs; --small: chat and spec)")
    p.add_argument("--small", action="store_true", help="the CPU job (house-qwen3, 8 x 4 over 1K tokens)")
    p.add_argument("--label", default=None, help="key of this run in the JSON (default: cpu-small / gpu); merge: "
                   "the file's run goes there whole, replacing that section (its rows from one run)")
    p.add_argument("--model-dir", default="/tmp/kvq_qwen3_4b_dummy")
    p.add_argument("--json", default=None)
    p.add_argument("--doc", default=None, help="render: write the markdown there too (docs/prefix_caching.md)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="full CUDA graphs for uniform decode batches in every engine (default: eager)")
    p.add_argument("--budget-s", type=float, default=None, help="chat job: submit no turn after this many seconds")
    p.add_argument("--timeout-s", type=float, default=None, help="time limit of each engine's run")
    for key, value in H200.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    p.add_argument("--kv-bytes", type=int, default=None)
    args = p.parse_args()
    for key, value in (SMALL if args.small else H200).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    out = Path(args.json or (Path(os.environ["OUT"]) / "prefix_chat.json" if "OUT" in os.environ else RESULTS))
    if args.mode == "run":
        print("RESULT " + json.dumps(run(args.engine, args)), flush=True)
        return
    if args.mode == "all":
        engines = [e for job in (args.jobs or (["chat", "spec"] if args.small else list(JOBS)))
                   for e in JOBS.get(job, (job,))]
        label = args.label or ("cpu-small" if args.small else "gpu")
        results = json.loads(out.read_text()) if out.exists() else {}
        job = results.get(label, {})
        shape = {k: getattr(args, k) for k in (SMALL | H200) if getattr(args, k, None) is not None}
        job.update({"platform": "CPU (vLLM CPU build, 2 cores shared)" if args.small else "CUDA", **shape,
                    "ngram": NGRAM, "eagle3": (dict(EAGLE3, draft="one layer, random weights")
                                              if any(e.endswith("_eagle3") for e in engines) else job.get("eagle3")),
                    "cuda_graphs": args.cuda_graphs})
        if any(e in CHAT_ENGINES for e in engines):  # a later speculation run keeps the chat job's budget
            job["budget_s"] = args.budget_s
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if args.small:  # numba's ngram threads otherwise fight torch's for the cores (5-20x slower steps)
            env.setdefault("NUMBA_NUM_THREADS", "1")
        job["numba_num_threads"] = env.get("NUMBA_NUM_THREADS")
        passed = [a for a in sys.argv[1:] if a != "all"]
        for name in engines:
            cmd = [sys.executable, "-m", "benchmarks.prefix_chat", "run", "--engine", name, *passed]
            job[name] = run_child(cmd, env, args.timeout_s)
            print(name, job[name], flush=True)
            job["device"] = job[name].get("device", job.get("device"))
            results[label] = job
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2))  # after each engine: a cut step keeps the finished ones
    if args.mode == "merge":
        results = json.loads(out.read_text()) if out.exists() else {}
        runs = [run for other in args.files for run in json.loads(Path(other).read_text()).items()]
        if args.label and len(runs) != 1:
            p.error(f"merge --label files one run, and {args.files} hold {len(runs)}: merge them one at a time")
        for label, job in runs:
            if args.label:  # the file's run as a section of its own, whole
                results[args.label] = job
            else:
                results.setdefault(label, {}).update(job)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
    text = render(json.loads(out.read_text()))
    if args.doc:
        Path(args.doc).write_text(text)
    print(text)


def _cell(r: dict) -> str | None:
    """None when the engine ran; else why not, for its row."""
    if not r:
        return "not run"
    if "error" in r:
        return "failed: " + r["error"].strip().splitlines()[-1][-100:].replace("|", "/") if r["error"].strip() \
            else "failed"
    return None


def render(results: dict) -> str:
    """docs/prefix_caching.md: one section per label of the JSON."""
    rows = ["# Prefix caching and speculative decoding: measured", "",
            "Written by `python -m benchmarks.prefix_chat render --doc docs/prefix_caching.md` from "
            "`benchmarks/results/prefix_chat.json`; the runs are `benchmarks/prefix_chat.py`'s (its docstring "
            "describes both jobs; `scripts/h200.sh prefix spec eagle` runs them on the GPU machine). The designs are in "
            "[design.md](design.md#prefix-caching) and [design.md](design.md#speculative-decoding).", ""]
    for label, job in results.items():
        model = ("house-qwen3 (real weights, held-out code)" if job.get("model") == "house"
                 else "Qwen3-4B shape, random weights, token-id prompts")
        where = job.get("platform", "?")
        memory = (f"gpu_memory_utilization {job['gpu_mem']}" if job.get("gpu_mem") is not None and where == "CUDA"
                  else f"{job.get('kv_bytes', 0) / 2**20:.0f} MiB of KV cache")
        mode = "full CUDA graphs for uniform decode batches" if job.get("cuda_graphs") else "eager"
        device = f" ({job['device']})" if job.get("device", "cpu") != "cpu" else ""
        rows += [f"## {label}: {where}{device}, {model}, {mode}", ""]
        if where.startswith("CPU"):
            rows += ["On CPU OSCAR runs the PyTorch reference ops (a loop over requests), so its speed there says "
                     "nothing about the Triton kernels; hit rates and acceptance do carry over.", ""]
        if any(job.get(e) for e in CHAT_ENGINES):
            budget = f"; no turn submitted after {job['budget_s']:.0f} s" if job.get("budget_s") else ""
            rows += [f"Chat job: {job['conversations']} conversations x {job['turns']} turns over a "
                     f"{job['doc_len']:,}-token document, {job['user_len']}-token questions, {job['gen']}-token "
                     f"answers, {memory}, {job['chunk']}-token chunks{budget}.", "",
                     "| engine | KV capacity (tokens) | requests done | hit rate (turns 2+) | TTFT p50 / p95 (s) | "
                     "generated tok/s | total tok/s |", "|---|---:|---:|---:|---:|---:|---:|"]
            for name in CHAT_ENGINES:
                r = job.get(name, {})
                why = _cell(r)
                if why:
                    rows.append(f"| {name} | {why} | | | | | |")
                    continue
                done = f"{r['requests']}" + ("" if r.get("complete", True) else " (cut)")
                rows.append(f"| {name} | {r['kv_cache_size_tokens']:,} | {done} | {r['hit_rate']:.1%} "
                            f"({r['hit_rate_after_turn_1']:.1%}) | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | "
                            f"{r['generated_tokens_per_s']:,.1f} | {r['total_tokens_per_s']:,.1f} |")
            a, b = job.get("oscar_apc", {}), job.get("bf16_apc", {})
            if "total_tokens_per_s" in a and "total_tokens_per_s" in b:
                rows += ["", f"OSCAR+APC / unquantized+APC job tokens/s: "
                             f"{a['total_tokens_per_s'] / b['total_tokens_per_s']:.2f}x."]
            rows.append("")
        if any(e in job for e in SPEC_ENGINES):
            requests = job.get("spec_requests", job.get("ngram_requests"))
            prompt = job.get("spec_prompt_len", job.get("ngram_prompt_len"))
            gen = job.get("spec_gen", job.get("ngram_gen"))
            rows += [f"Speculation job: {requests} requests of {prompt:,} prompt tokens decoding {gen} tokens, "
                     f"{DRAFTS} draft tokens a step (ngram: prompt lookup of 2-4 tokens"
                     + ("; EAGLE-3: a one-layer head of random weights, so drafts are nearly never accepted"
                        if job.get("eagle3") else "") + ").", "",
                     "| engine | KV capacity (tokens) | decode tok/s | vs. no speculation | acceptance |",
                     "|---|---:|---:|---:|---:|"]
            for name in SPEC_ENGINES:
                if name.endswith("_eagle3") and name not in job:
                    continue
                r = job.get(name, {})
                why = _cell(r)
                if why:
                    rows.append(f"| {name} | {why} | | | |")
                    continue
                rate, plain = r.get("acceptance_rate"), job.get(name.split("_")[0] + "_plain", {})
                speeds = (r.get("decode_tokens_per_s"), plain.get("decode_tokens_per_s"))
                ratio = f"{speeds[0] / speeds[1]:.2f}x" if all(speeds) and plain is not r else ""
                rows.append(f"| {name} | {r['kv_cache_size_tokens']:,} | {r['decode_tokens_per_s']:,.1f} | {ratio} | "
                            f"{'-' if rate is None else f'{rate:.1%}'} |")
            rows.append("")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
