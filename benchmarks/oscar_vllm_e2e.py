"""End-to-end serving job in real vLLM: OSCAR against BF16 (TRITON_ATTN).

A random-weight Qwen3-4B-shaped model (vLLM's ``load_format="dummy"``:
speed does not depend on weights) serves the same job with each backend at
the same ``gpu_memory_utilization``: N requests with P-token prompts that
generate G tokens each, more requests than either backend can hold at once.
It reports the KV capacity vLLM states at start (tokens) and the figures of
``serving_job.run_job`` (concurrent batch, steady-state decode, prefill and
job tokens/s).

Each backend runs in its own process (``run`` sub-command); the parent
writes ``benchmarks/results/oscar_vllm_e2e.json`` (or ``$OUT``) and prints a
table. Needs a GPU and vLLM 0.32 (``scripts/h200.sh`` runs it). Engines run
eagerly, or with ``--cuda-graphs`` both with full CUDA graphs for decode-only
batches (``GRAPHS``: no torch.compile; other batches eager).

    python -m benchmarks.oscar_vllm_e2e --prompt-len 32768 --gen 512 --requests 16 --gpu-mem 0.15
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.serving_job import GRAPHS, run_child, run_job
from evalkit.data import REPO
from evalkit.markdown import table

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
BACKENDS = {"bf16": ("TRITON_ATTN", None), "oscar": ("OSCAR", {"rotation": "hadamard"}), "tiered": ("OSCAR", None)}
PLANS = REPO / "examples" / "artifacts" / "house-qwen3-auto80"
"""Where the ``tiered`` run takes its tier plan: the 80-byte plan calibration
chose for house-qwen3 (one for every layer), over the 36 layers."""


def tiered_artifact(model: Path) -> str:
    """An artifact for the random-weight model: Hadamard rotations, zero fills
    and the calibrated 80-byte plans of :data:`PLANS`, one per layer in turn
    (each layer launches the kernels with its own tier list, as a hand-written
    per-layer artifact would)."""
    import torch
    from transformers import AutoConfig

    from vllm_kvq.artifacts.builtin import builtin_artifact
    from vllm_kvq.artifacts.fingerprint import model_fingerprint
    from vllm_kvq.kernels.oscar.format import LayerTiers

    plans = list(json.loads((PLANS / "manifest.json").read_text())["tiers"].values())
    art = builtin_artifact(model_fingerprint(AutoConfig.from_pretrained(model)), "hadamard")
    art.granularity = "kv_head"  # tiers live in each KV head's basis: the Hadamard rotation, once per head
    for rot in (art.k_rotation, art.v_rotation):
        rot.update({layer: r.expand(art.num_kv_heads, *r.shape).clone() for layer, r in rot.items()})
    art.tiers = {layer: LayerTiers.from_json(plans[i % len(plans)], str(PLANS))
                 for i, layer in enumerate(art.layers)}
    art.fill = {kind: {layer: torch.zeros(art.num_kv_heads, getattr(art.tiers[layer], kind).zero)
                       for layer in art.layers if getattr(art.tiers[layer], kind).zero}
                for kind in ("k", "v")}
    return str(art.save(model / "tiered-artifact"))


def run(backend: str, args: argparse.Namespace) -> dict:
    """One backend, one job, stepped in this process."""
    import torch

    import vllm_kvq

    vllm_kvq.register()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    attention, kvq = BACKENDS[backend]
    model = Path(args.model_dir)
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_4B))
    if backend == "tiered":
        kvq = {"artifact": tiered_artifact(model)}
    kw = {"additional_config": {"kvq": kvq}} if kvq is not None else {}
    if args.cuda_graphs:
        kw.update(enforce_eager=False, compilation_config=dict(GRAPHS))
    else:
        kw.update(enforce_eager=True)
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, attention_backend=attention,
              max_model_len=args.prompt_len + args.gen, gpu_memory_utilization=args.gpu_mem,
              enable_prefix_caching=False, async_scheduling=False, seed=0, **kw)
    from vllm.compilation.counter import compilation_counter

    graphs = {"cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
              "graphs_captured": compilation_counter.num_cudagraph_captured}
    capacity = llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
    params = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True, detokenize=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, QWEN3_4B["vocab_size"], (args.prompt_len,),
                                                           generator=gen).tolist())
               for _ in range(args.requests)]
    return {"backend": attention, "kv_cache_size_tokens": capacity, **run_job(llm, prompts, params), **graphs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="all", choices=["all", "run", "render"])
    p.add_argument("--backend", default="oscar", choices=sorted(BACKENDS), help="the backend of one 'run'")
    p.add_argument("--note", help="a remark on this run, kept with its results")
    p.add_argument("--backends", nargs="+", default=["bf16", "oscar"], choices=sorted(BACKENDS),
                   help="the backends of 'all', each in its own process (bf16 is the ratios' baseline)")
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--gen", type=int, default=512)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--gpu-mem", type=float, default=0.15)
    p.add_argument("--model-dir", default="/tmp/kvq_qwen3_4b_dummy")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="full CUDA graphs for decode-only batches in both engines (default: eager)")
    p.add_argument("--label", default=None,
                   help="key of this job in the JSON (default: the prompt length, '-graphs' with --cuda-graphs)")
    p.add_argument("--json", default=None)
    p.add_argument("--timeout-s", type=float, default=None, help="time limit of each backend's run")
    args = p.parse_args()
    out = Path(args.json or (Path(os.environ["OUT"]) / "oscar_vllm_e2e.json" if "OUT" in os.environ
                             else Path(__file__).parent / "results" / "oscar_vllm_e2e.json"))
    if args.mode == "run":
        print("RESULT " + json.dumps(run(args.backend, args)), flush=True)
        return
    if args.mode == "all":
        job = {"prompt_len": args.prompt_len, "gen": args.gen, "requests": args.requests,
               "gpu_memory_utilization": args.gpu_mem, "model": "Qwen3-4B shape, dummy weights",
               "enforce_eager": not args.cuda_graphs, "compilation_config": GRAPHS if args.cuda_graphs else None}
        if args.note:
            job["note"] = args.note
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        for name in args.backends:
            cmd = [sys.executable, "-m", "benchmarks.oscar_vllm_e2e", "run", "--backend", name] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k in ("prompt_len", "gen", "requests", "gpu_mem", "model_dir")] + (
                ["--cuda-graphs"] if args.cuda_graphs else [])
            job[name] = run_child(cmd, env, args.timeout_s)
            print(name, job[name], flush=True)
        results = json.loads(out.read_text()) if out.exists() else {}
        results[args.label or str(args.prompt_len) + ("-graphs" if args.cuda_graphs else "")] = job
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
    print(render(json.loads(out.read_text())))


RATIOS = ("kv_cache_size_tokens", "concurrent_batch", "decode_tokens_per_s", "prefill_tokens_per_s",
          "job_generated_tokens_per_s")


def render(results: dict) -> str:
    """One row per backend of each job, and each quantized backend's ratios
    to the BF16 run of the same job."""
    fmt = lambda x: f"{x:,.0f}" if x else "-"  # noqa: E731
    rows = []
    for job in results.values():
        shape = f"{job['requests']} x {job['prompt_len']} + {job['gen']}"
        shape += ", CUDA graphs" if job.get("compilation_config") else ""
        shape += f", {job['device'].removeprefix('NVIDIA ').split()[0]}" if job.get("device") else ""
        ran = [name for name in BACKENDS if name in job]
        for name in ran:
            r = job[name]
            if "error" in r or "decode_tokens_per_s" not in r:
                rows.append([shape, name, "failed", "", "", "", ""])
                continue
            rows.append([shape, f"{name} ({r['backend']})", f"{r['kv_cache_size_tokens']:,}", r["concurrent_batch"],
                         fmt(r["decode_tokens_per_s"]), fmt(r["prefill_tokens_per_s"]),
                         f"{r['job_generated_tokens_per_s']:,.1f}"])
        base = job.get("bf16", {})
        for name in ran:
            r = job[name]
            if name == "bf16" or "decode_tokens_per_s" not in r or "decode_tokens_per_s" not in base:
                continue
            rows.append(["", f"{name} / bf16"] + [f"{r[k] / base[k]:.2f}x" if r.get(k) and base.get(k) else ""
                                                 for k in RATIOS])
    header = ["job", "backend", "KV capacity (tokens)", "concurrent batch", "decode tok/s", "prefill tok/s", "job tok/s"]
    return "\n".join(table(header, rows, "llrrrrr"))


if __name__ == "__main__":
    main()
