"""OSCAR's decode under full CUDA graphs in real vLLM, against the same engine run eagerly.

Runs on a GPU machine with vLLM 0.32 (``bash scripts/h200.sh graphs`` runs it),
with house-qwen3 from ``.device-carry/house-qwen3`` (scripts/pack_for_gpu.py):

* ``oscar_eager``: ``attention_backend="OSCAR"`` (Hadamard, sink 64, window
  256), ``enforce_eager=True``;
* ``oscar_graphs``: the same with full CUDA graphs for decode-only batches and
  no torch.compile (``compilation_config={"mode": 0, "cudagraph_mode":
  "FULL_DECODE_ONLY", "cudagraph_capture_sizes": CAPTURE_SIZES}``); batches
  with a prefill chunk run eagerly;
* ``oscar_compiled``: OSCAR under vLLM's default for a GPU engine, torch.compile
  with ``FULL_AND_PIECEWISE`` graphs (full graphs for decode-only batches,
  piecewise ones around attention for the rest), the same capture sizes;
* ``bf16_eager`` / ``bf16_graphs``: TRITON_ATTN the same two ways, the control
  (how far graphs move a backend that vLLM itself ships with graph support).

Request counts that are not capture sizes (45 of the 200-token prompts, 7 of
the 1500-token ones, whose INT2 pages are active) make vLLM pad every decode
batch: padding rows have length 0, slot -1 and a NULL block-table row, and
must change nothing. Prefills are chunked (2048 tokens a step), so decodes
also run inside eager mixed batches.

Reported per mode: greedy tokens and their top-2 logprobs (as
scripts/cuda_check.py), and the graph record: graphs captured, graph replays
during generation, and what OSCAR saw (its metadata builds by kind, how many
decode builds had padding rows, its forward calls on decode-only batches:
none when every decode step replays a graph). Each graphs mode is compared
with its eager mode (``evalkit.compare``: tokens equal up to the eager run's
first near tie, where they first differ, |dlogprob|); OSCAR eager is also compared
with BF16 eager on the 200-token prompts (a store that wrote nothing would
show there, not between two OSCAR runs). Each engine runs in its own
process (a failed start is reported and the next mode still runs); the
summary is rewritten after each one, to ``$OUT/cuda_graph_check.json``.

    python -m scripts.cuda_graph_check [--modes oscar_eager oscar_graphs ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from evalkit.compare import compare, record
from scripts import cuda_check  # the model restore, the prompts, the engine's records

OUT = Path(os.environ.get("OUT", "/tmp/kvq_out"))
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": CAPTURE_SIZES}
OSCAR = {"rotation": "hadamard"}
MODES = {  # name: (attention backend, graphs: False, True (GRAPHS) or "default" (vLLM's own))
    "oscar_eager": ("OSCAR", False),
    "oscar_graphs": ("OSCAR", True),
    "oscar_compiled": ("OSCAR", "default"),
    "bf16_eager": ("TRITON_ATTN", False),
    "bf16_graphs": ("TRITON_ATTN", True),
}
PAIRS = {"oscar": ("oscar_eager", "oscar_graphs"), "oscar_compiled": ("oscar_eager", "oscar_compiled"),
         "bf16": ("bf16_eager", "bf16_graphs")}
FULL_MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")  # the modes that capture decode-only batches whole


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--short", type=int, default=45, help="200-token prompts (of 48), not a capture size")
    p.add_argument("--long", type=int, default=7, help="1500-token prompts (of 8), not a capture size")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kvq", default=json.dumps(OSCAR), help="OSCAR settings (JSON)")
    p.add_argument("--timeout", type=int, default=200, help="seconds per engine")
    p.add_argument("--json", default=None, help=f"summary path (default {OUT}/cuda_graph_check.json)")
    # internal: one engine in this process
    p.add_argument("--engine", default=None, choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--engine-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, n in (("short", args.short), ("long", args.long)):
        if n in CAPTURE_SIZES:
            p.error(f"--{name} {n} is a capture size: pick one that vLLM has to pad")
    return args


def engine_kwargs(backend: str, graphs: bool, kvq: dict) -> dict:
    kw = dict(model=str(cuda_check.MODEL_DIR), skip_tokenizer_init=True, max_model_len=4096,
              gpu_memory_utilization=0.3, enable_prefix_caching=False, block_size=128, seed=0,
              max_num_seqs=max(CAPTURE_SIZES), max_num_batched_tokens=2048, enable_chunked_prefill=True,
              attention_backend=backend)
    if backend == "OSCAR":
        kw["additional_config"] = {"kvq": kvq}
    if graphs == "default":
        kw.update(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES})
    elif graphs:
        kw.update(enforce_eager=False, compilation_config=dict(GRAPHS))
    else:
        kw.update(enforce_eager=True)
    return kw


class GraphRecord:
    """Counts, in this process, graph captures and replays and what OSCAR's
    builder and forward see; ``live`` switches counting on after start-up."""

    def __init__(self) -> None:
        self.live = False
        self.replays = 0
        self.builds = {"decode": 0, "mixed": 0}
        self.padded_decode_builds = 0
        self.decode_rows: dict[str, int] = {}  # "real->rows": builds
        self.forward = {"decode": 0, "mixed": 0}

    def install(self) -> None:
        import torch

        record = self
        replay = torch.cuda.CUDAGraph.replay

        def counted_replay(graph, *a, **kw):
            if record.live:
                record.replays += 1
            return replay(graph, *a, **kw)

        torch.cuda.CUDAGraph.replay = counted_replay

        from vllm_kvq.backends import oscar

        build, forward = oscar.OscarMetadataBuilder.build, oscar.OscarImpl.forward

        def counted_build(builder, common_prefix_len, common_attn_metadata, *a, **kw):
            md = build(builder, common_prefix_len, common_attn_metadata, *a, **kw)
            m = common_attn_metadata
            if record.live:
                qsl = m.query_start_loc_cpu[: m.num_reqs + 1]
                real = int((qsl[1:] > qsl[:-1]).sum())  # host copy: no sync
                kind = "decode" if m.max_query_len <= 1 else "mixed"
                record.builds[kind] += 1
                if kind == "decode":
                    key = f"{real}->{m.num_reqs}"
                    record.decode_rows[key] = record.decode_rows.get(key, 0) + 1
                    record.padded_decode_builds += real < m.num_reqs
            return md

        def counted_forward(impl, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
            if record.live and attn_metadata is not None:
                decode_only = attn_metadata.num_decodes == attn_metadata.num_actual_tokens
                record.forward["decode" if decode_only else "mixed"] += 1
            return forward(impl, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)

        oscar.OscarMetadataBuilder.build = counted_build
        oscar.OscarImpl.forward = counted_forward

    def as_dict(self) -> dict:
        return {"graph_replays": self.replays, "oscar_builds": self.builds,
                "oscar_padded_decode_builds": self.padded_decode_builds,
                "oscar_decode_rows_real_to_padded": self.decode_rows,
                "oscar_forward_calls": self.forward}


def run_engine(mode: str, args: argparse.Namespace) -> None:
    """One engine (in-process engine core, so the counters see the model runner)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm_kvq

    vllm_kvq.register()
    graph_record = GraphRecord()
    graph_record.install()
    from vllm import LLM, SamplingParams
    from vllm.compilation.counter import compilation_counter
    from vllm.inputs import TokensPrompt

    backend, graphs = MODES[mode]
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(backend, graphs, json.loads(args.kvq)))
    cc = llm.llm_engine.vllm_config.compilation_config
    result = {"mode": mode, "backend": backend, "start_s": time.perf_counter() - t0,
              "cudagraph_mode": str(cc.cudagraph_mode), "compilation_mode": str(cc.mode),
              "capture_sizes": list(cc.cudagraph_capture_sizes or []),
              "graphs_captured": compilation_counter.num_cudagraph_captured,
              "kv_cache_size_tokens": llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens}
    print("ENGINE", json.dumps(result), flush=True)
    graph_record.live = True
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=2, detokenize=False)
    for kind, count in (("short", args.short), ("long", args.long)):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cuda_check.prompts(kind)[:count]], params,
                            use_tqdm=False)
        result[kind] = record(outs)
    graph_record.live = False
    result["record"] = graph_record.as_dict()
    result["generate_s"] = time.perf_counter() - t0 - result["start_s"]
    Path(args.engine_out).write_text(json.dumps(result))


def graph_evidence(run: dict) -> dict:
    """Were graphs captured, and did every decode-only step replay one? (Piecewise
    graphs replay too, several a step: a decode step's own replay shows as no
    eager OSCAR forward on a decode-only batch.)"""
    rec = run.get("record", {})
    ev = {"graphs_captured": run.get("graphs_captured", 0), "graph_replays": rec.get("graph_replays", 0),
          "full_decode_mode": any(m in run.get("cudagraph_mode", "") for m in FULL_MODES)}
    if run.get("backend") == "OSCAR":
        decode_builds = rec.get("oscar_builds", {}).get("decode", 0)
        ev.update(decode_steps=decode_builds, padded_decode_steps=rec.get("oscar_padded_decode_builds", 0),
                  eager_decode_forwards=rec.get("oscar_forward_calls", {}).get("decode", 0))
        piecewise = "PIECEWISE" in run.get("cudagraph_mode", "")
        ev["every_decode_step_replayed"] = (ev["eager_decode_forwards"] == 0 and decode_builds > 0
                                            and (ev["graph_replays"] >= decode_builds if piecewise
                                                 else ev["graph_replays"] == decode_builds))
    ev["ok"] = (ev["full_decode_mode"] and ev["graphs_captured"] > 0 and ev["graph_replays"] > 0
                and ev.get("every_decode_step_replayed", True))
    return ev


def summarize(results: dict, args: argparse.Namespace) -> dict:
    summary: dict = {"requests": {"short_200": args.short, "long_1500": args.long}, "capture_sizes": CAPTURE_SIZES,
                     "compilation_config": GRAPHS, "kvq": json.loads(args.kvq), "modes": {}}
    for name, r in results.items():
        if "error" in r:
            summary["modes"][name] = {"error": r["error"]}
            continue
        summary["modes"][name] = {k: r.get(k) for k in ("cudagraph_mode", "compilation_mode", "graphs_captured",
                                                        "kv_cache_size_tokens", "start_s", "generate_s", "record")}
    checks = []
    for backend, (eager, graphs) in PAIRS.items():
        if eager not in results or graphs not in results:
            continue
        if "error" in results[eager] or "error" in results[graphs]:
            summary[backend] = {"error": "an engine failed; see modes"}
            checks.append(backend == "bf16")
            continue
        res = {"graphs": graph_evidence(results[graphs]), "eager": graph_evidence(results[eager]),
               "short_200": compare(results[graphs]["short"], results[eager]["short"]),
               "long_1500": compare(results[graphs]["long"], results[eager]["long"])}
        res["ok"] = (res["graphs"]["ok"] and res["eager"]["graph_replays"] == 0
                     and all(res[k]["equal_up_to_tie"] == res[k]["prompts"] for k in ("short_200", "long_1500")))
        summary[backend] = res
        checks.append(res["ok"])
    if all(m in results and "error" not in results[m] for m in ("oscar_eager", "bf16_eager")):
        # sanity: OSCAR stores and reads what it should (200-token prompts fit sink + window)
        sanity = compare(results["oscar_eager"]["short"], results["bf16_eager"]["short"])
        summary["oscar_eager_vs_bf16_eager_short_200"] = sanity
        checks.append(sanity["equal_up_to_tie"] == sanity["prompts"])
    summary["ok"] = "oscar" in summary and "error" not in summary["oscar"] and all(checks)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine:
        run_engine(args.engine, args)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    out = Path(args.json or OUT / "cuda_graph_check.json")
    try:
        cuda_check.make_model()
    except Exception:
        out.write_text(json.dumps({"ok": False, "error": "model restore failed: " + traceback.format_exc()[-1500:]}))
        print(traceback.format_exc(), flush=True)
        return 1
    import torch

    device = torch.cuda.get_device_name(0)
    results: dict = {}
    for mode in args.modes:
        path, log = OUT / f"cuda_graph_{mode}.json", OUT / f"cuda_graph_{mode}.log"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "scripts.cuda_graph_check", "--engine", mode, "--engine-out", str(path), "--short", str(args.short),
               "--long", str(args.long), "--max-tokens", str(args.max_tokens), "--kvq", args.kvq]
        t = time.perf_counter()
        try:
            with log.open("w") as f:
                proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        text = log.read_text(errors="replace") if log.exists() else ""
        if rc == 0 and path.exists():
            results[mode] = cuda_check.read_run(path)
            # vLLM's own word: the capture progress and time, any fallback of the graph mode
            marks = ("Graph capturing finished", "Capturing CUDA graphs", "is not supported with")
            results[mode]["vllm_log"] = [x.strip()[:300] for x in text.splitlines()
                                         if any(k in x for k in marks)][-6:]
        else:
            errors = [x for x in text.splitlines() if "Error" in x or "error" in x][-5:]
            results[mode] = {"error": f"rc={rc}", "error_lines": errors, "log_tail": text[-3000:]}
        print(f"{mode}: {'ok' if 'error' not in results[mode] else results[mode]['error']} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        if "error" in results[mode]:
            print(results[mode]["log_tail"][-1500:], flush=True)
        summary = {"device": device, "date": time.strftime("%Y-%m-%d"), **summarize(results, args)}
        summary["mode_results"] = {m: {k: r[k] for k in ("error", "error_lines", "vllm_log") if k in r}
                                   for m, r in results.items()}
        out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "modes"}, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
