"""End-to-end serving job in real vLLM: the packed GDN state pool against
vLLM's FP32 states, at the batch a fixed cache budget allows.

A hybrid model serves the same job with each state pool under the same
``kv_cache_memory_bytes`` (attention KV, conv and recurrent states share it):
N requests with P-token prompts that generate G tokens each, more than the
FP32 pool can hold at once. Short prompts make the recurrent state, not the
attention KV, what limits the batch, as in many-user serving of a hybrid.

Pools: ``fp32`` (vLLM's own), ``int6`` (uniform 6-bit, the STEPQuant @6
record size), ``stepquant6`` (a STEPQuant @6 plan: on CUDA a synthetic plan
of mixed widths and pivots for the random dense model, on CPU house-qwen3next's
calibrated one). Per pool: allocated state bytes per request (all GDN
layers), the KV capacity vLLM states at start, and the figures of
``serving_job.run_job`` (concurrent batch, steady-state decode, prefill and
job tokens/s), with ratios against ``fp32`` from the same call.

Models: on CUDA a dense Qwen3.5-style model with random weights (16 layers,
12 GDN layers of 16 value heads of 128 x 128; the CUDA bundle of vLLM has no MoE
kernels), decode batches through the Triton step; on CPU house-qwen3next
(the staged reference codec). Engines run eagerly, or with ``--cuda-graphs``
full CUDA graphs for decode-only batches in every engine (``serving_job.GRAPHS``;
the job's key becomes ``cuda-graphs``), each pool in its own process with its
own time limit; results go to ``benchmarks/results/stepquant_vllm_e2e.json``
(or ``$OUT``).

    python -m benchmarks.stepquant_vllm_e2e --requests 512 --prompt-len 256 --gen 128 --kv-gib 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from benchmarks.serving_job import GRAPHS, run_child, run_job
from evalkit.data import MODELS, REPO
from evalkit.markdown import table
from scripts.cuda_state_check import LARGE, model_dir, synthetic_plan

POOLS = {"fp32": None, "int6": {"state": "uniform", "state_bits": 6},
         "stepquant6": {"state": "stepquant", "state_bits": 6, "state_artifact": "PLAN"},
         "stepquant6-refit4": {"state": "stepquant", "state_bits": 6, "state_artifact": "PLAN", "state_refit_every": 4},
         "stepquant6-refit8": {"state": "stepquant", "state_bits": 6, "state_artifact": "PLAN", "state_refit_every": 8}}
HOUSE_PLAN = REPO / "examples" / "artifacts" / "house-qwen3next-stepquant"


def setup(cuda: bool) -> tuple[str, str, dict]:
    """(model path, plan path, engine keyword arguments) for this device."""
    if cuda:
        model = model_dir(LARGE, "kvq_gdn_large")
        plan = synthetic_plan(LARGE, Path("/tmp") / "kvq_gdn_large_plan")
        # the bundle has no FlashInfer: vLLM's Triton GDN prefill
        return model, plan, dict(load_format="dummy", skip_tokenizer_init=True, attention_backend="TRITON_ATTN",
                                 additional_config={"gdn_prefill_backend": "triton"})
    return str(MODELS / "house-qwen3next"), str(HOUSE_PLAN), dict(additional_config={})


def run(pool: str, args: argparse.Namespace) -> dict:
    """One pool, one job, stepped in this process."""
    import torch

    import vllm_kvq

    vllm_kvq.register()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from evalkit.probe import allocated_state_bytes, count_fused_decodes

    cuda = torch.cuda.is_available()
    model, plan, kw = setup(cuda)
    kvq = POOLS[pool]
    if kvq is not None:
        kvq = {**kvq, "state_artifact": plan} if kvq.get("state_artifact") == "PLAN" else dict(kvq)
        kw["additional_config"] = {**kw["additional_config"], "kvq": kvq}
    if args.cuda_graphs:
        kw.update(enforce_eager=False, compilation_config=dict(GRAPHS))
    else:
        kw.update(enforce_eager=True)
    llm = LLM(model=model, dtype="bfloat16", mamba_ssm_cache_dtype="float32",
              max_model_len=args.prompt_len + args.gen, max_num_seqs=args.requests,
              kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)), enable_prefix_caching=False,
              async_scheduling=False, seed=0, **kw)
    layers = llm.apply_model(allocated_state_bytes)[0]
    llm.apply_model(count_fused_decodes)  # triton_decode below: the packed pools' decode batches took the Triton step
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, vocab - 10, (args.prompt_len,), generator=gen).tolist())
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)  # warm-up, compiles
    res = {"pool": pool, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "model": ("dense Qwen3.5-style, 12 GDN layers of 16 value heads, random weights" if cuda
                     else "house-qwen3next"),
           "state_bytes_per_request": sum(x["page_bytes"] for x in layers),
           "kv_cache_size_tokens": llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens,
           **run_job(llm, prompts, params)}
    res["cudagraph_mode"] = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    if any(x["bits"] is not None for x in layers):
        packed = [x for x in llm.apply_model(allocated_state_bytes)[0] if x["bits"] is not None]
        calls = [x["triton_calls"] for x in packed]
        res["triton_decode"] = min(calls) > 0
        res["triton_calls_per_layer"] = max(calls)  # with graphs: warm-ups and captures, not replays
        res["mixed_calls_per_layer"] = max(x["mixed_calls"] for x in packed)  # steps that also prefilled
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="all", choices=["all", "run", "render"])
    p.add_argument("--pool", default="fp32", choices=sorted(POOLS))
    p.add_argument("--pools", nargs="*", default=list(POOLS), choices=sorted(POOLS))
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--kv-gib", type=float, default=2.0, help="kv_cache_memory_bytes of every engine, in GiB")
    p.add_argument("--label", default=None, help="key of this job in the JSON (default: the device)")
    p.add_argument("--json", default=None)
    p.add_argument("--timeout-s", type=float, default=None, help="time limit of each pool's run")
    p.add_argument("--note", help="a remark on this run, kept with its results")
    p.add_argument("--cuda-graphs", action="store_true", help="full CUDA graphs for decode-only batches (GRAPHS)")
    args = p.parse_args()
    out = Path(args.json or (Path(os.environ["OUT"]) / "stepquant_vllm_e2e.json" if "OUT" in os.environ
                             else REPO / "benchmarks" / "results" / "stepquant_vllm_e2e.json"))
    if args.mode == "run":
        print("RESULT " + json.dumps(run(args.pool, args)), flush=True)
        return
    if args.mode == "all":
        job = {"date": str(datetime.date.today()), "requests": args.requests, "prompt_len": args.prompt_len,
               "gen": args.gen, "kv_gib": args.kv_gib, "cuda_graphs": args.cuda_graphs}
        if args.note:
            job["note"] = args.note
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        for pool in args.pools:
            cmd = [sys.executable, "-m", "benchmarks.stepquant_vllm_e2e", "run", "--pool", pool, f"--requests={args.requests}",
                   f"--prompt-len={args.prompt_len}", f"--gen={args.gen}", f"--kv-gib={args.kv_gib}"]
            cmd += ["--cuda-graphs"] if args.cuda_graphs else []
            job[pool] = run_child(cmd, env, args.timeout_s)
            print(pool, job[pool], flush=True)
        base = job.get("fp32", {})
        for pool in args.pools:
            r = job[pool]
            if pool == "fp32" or "error" in r or "error" in base:
                continue
            r["vs_fp32"] = {k: r[k] / base[k] for k in ("state_bytes_per_request", "kv_cache_size_tokens",
                                                         "concurrent_batch", "decode_tokens_per_s",
                                                         "prefill_tokens_per_s", "job_generated_tokens_per_s")
                            if r.get(k) and base.get(k)}
        results = json.loads(out.read_text()) if out.exists() else {}
        device = next((r["device"] for r in job.values() if isinstance(r, dict) and "device" in r), "failed")
        results[args.label or ("cpu" if device == "cpu" else "cuda-graphs" if args.cuda_graphs else "cuda")] = job
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
    print(render(json.loads(out.read_text())))


def render(results: dict) -> str:
    fmt = lambda x: f"{x:,.0f}" if x else "-"  # noqa: E731
    rows = []
    for label, job in results.items():
        shape = f"{label}: {job['requests']} x {job['prompt_len']} + {job['gen']}, {job['kv_gib']:g} GiB"
        model = next((r["model"] for r in job.values() if isinstance(r, dict) and "model" in r), "")
        shape += f" ({model})" if model else ""
        for pool in POOLS:
            r = job.get(pool)
            if r is None:
                continue
            if "error" in r:
                rows.append([shape, pool, "failed", "", "", "", "", ""])
                continue
            rows.append([shape, pool, fmt(r["state_bytes_per_request"]), fmt(r["kv_cache_size_tokens"]),
                         r["concurrent_batch"], fmt(r["decode_tokens_per_s"]), fmt(r["prefill_tokens_per_s"]),
                         f"{r['job_generated_tokens_per_s']:,.1f}"])
            v = r.get("vs_fp32")
            if v:
                x = lambda k: f"{v[k]:.2f}x" if k in v else ""  # noqa: E731
                smaller = f"1/{1 / v['state_bytes_per_request']:.2f}" if "state_bytes_per_request" in v else ""
                rows.append(["", f"{pool} / fp32", smaller, *(x(k) for k in (
                    "kv_cache_size_tokens", "concurrent_batch", "decode_tokens_per_s", "prefill_tokens_per_s",
                    "job_generated_tokens_per_s"))])
    header = ["job", "pool", "state B/request", "KV capacity (tokens)", "concurrent batch", "decode tok/s",
              "prefill tok/s", "job tok/s"]
    return "\n".join(table(header, rows, "llrrrrrr"))

if __name__ == "__main__":
    main()
