"""The GDN state pool (``kvq.state``) in real vLLM on CUDA.

vLLM's CUDA build here has no MoE kernels, so the model is a dense
Qwen3.5-style text model (house-qwen3next's shape: 3 GDN layers per full
attention layer, 4 value heads of 128 x 128) with random weights: tokens are
meaningless, but they are deterministic, so the packed pools can be compared
with vLLM's own FP32 states token for token.

On CUDA, decode batches run the split STEPQuant Triton step on the pool in
place; ``kvq.kernels: "reference"`` keeps them staged (unpack, vLLM's own
ops, refit with the reference codec), as prefill always is. Variants ending
in ``_staged`` run that way, the others through the Triton step; every engine
reports which path its decode batches took, and a mismatch is listed under
``problems``.

1. ``check``: random prompts, greedy, with log-probabilities. FP32 states
   against the FP16 pool, uniform INT6, and a synthetic STEPQuant plan (mixed
   widths 2-8 and FP16 pivots, random impacts) through the Triton step and
   staged. Random weights make nearly every step a near tie, so the check is
   on log-probabilities up to each prompt's first differing token: the FP16
   pool's must be within 0.01 of FP32's on average, and the Triton step's
   within 0.01 of the staged path's on the same plan. Prompts are chunked
   at 512 tokens a step, so decodes share steps with prefills: every Triton
   engine must also have sent such a step's decode rows through the split
   step (``mixed_calls_per_layer``). The control: uniform
   INT6 must move them at all, or the check cannot see the states. The plan
   with held updates (``state_refit_every: 4``) must be no further from FP32
   than the plan refitted every step (within 10%), and under full graphs
   within 0.001 of its eager run, having replayed. The plan
   again with full CUDA graphs for decode-only batches (``GRAPHS``, padded
   batches included) must be within 0.001 of its eager run (a tenth of the
   staged path's distance from the Triton step: graphs that held the staged
   path would fail), and must have replayed: every layer counts the decode
   batches that ran the step from Python, and with graphs none of the job's
   may (``triton_calls_in_job``; captures happen before the count starts,
   so such an engine's decode path reads ``graph``).
   vLLM's default graph mode must be refused at start, naming the fix.
   Variants starting with ``oscar_`` put OSCAR (Hadamard, INT2 past a
   16-token sink and 32-token window) on the attention layers too, at the
   long, state-sized blocks vLLM gives a hybrid: its Triton kernels must be
   within 0.03 of its reference ops (fp16 tensor-core operands) with the same
   pool, and under graphs within 0.001 of eager, having replayed. The
   control: the same pool with BF16 attention (``stepquant_mixed``) must
   differ from it, or the check cannot see the attention cache.
2. ``speed``: a larger model (16 value heads of 128 x 128 per GDN layer), 512
   requests decoding at once (eager): tokens/s with FP32 states, the INT6
   pool through the Triton step, and staged. ``tok_s`` is the whole
   generate call (prefill included), ``decode_tok_s`` the decode part only
   (approximately: the same prompts with one output token, timed just before,
   subtracted).

Each engine runs in its own process with its own time limit, in order of
importance; a failed engine is reported (error and log tail; full log in
``$OUT/state_<step>_<name>.log``) and the others still run; jobs that would start
past ``--budget-s`` are skipped. Results: ``$OUT/cuda_state_check.json``,
rewritten after every engine. The whole check takes longer than one 10-minute
device call: with ``--keep DIR`` every finished engine's result is kept in DIR
and taken from there by the next call on the same machine instead of run again
(``from_earlier_call``), so consecutive calls complete it.

    python -m scripts.cuda_state_check [check] [speed] [--only NAME ...] [--budget-s 540] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from evalkit.compare import compare, from_json, record

OUT = Path(os.environ.get("OUT", "/tmp/kvq_out"))
SMALL = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "dtype": "bfloat16",
    "hidden_size": 512, "intermediate_size": 768, "num_hidden_layers": 8, "head_dim": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6, "max_position_embeddings": 16384, "vocab_size": 8192, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1, "hidden_act": "silu", "attention_bias": False,
}
LARGE = {**SMALL, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 4, "linear_num_key_heads": 4, "linear_num_value_heads": 16,
         "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 4, "vocab_size": 32000}
# Synthetic STEPQuant widths per 4 value heads (repeated for more heads), cycled over the GDN layers: every
# width and FP16 pivots (16), within the budget (a pivot counts as 8 bits).
PLAN_WIDTHS = {6: [(16, 6, 4, 2), (8, 6, 6, 4), (2, 8, 6, 8)], 4: [(16, 4, 2, 2), (6, 4, 4, 2), (4, 4, 4, 4)]}
STAGED = {"kernels": "reference"}
OSCAR = {"rotation": "hadamard", "sink": 16, "window": 32}  # the attention layers' cache, INT2 in 400-token prompts
MIXED = {"state": "stepquant", "state_bits": 6, "state_artifact": "PLAN"}
# Full CUDA graphs for decode-only batches; 16 requests pad to the capture size 24 (padding rows: slot -1)
GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8, 24]}

GRAPH_BOUND = 0.001  # mean |dlogprob| of a graph engine from its eager twin
# 512 tokens a step: prompts are chunked, so decodes share steps with prefills (the split step's mixed batches)
CHECK = dict(model="small", mem=0.2, max_len=2048, batch=16, requests=16, prompt_len=400, gen=32, logprobs=True,
             timeout=240, batched_tokens=512)
SPEED = dict(model="large", mem=0.5, max_len=1024, batch=512, requests=512, prompt_len=256, gen=64, logprobs=False,
             timeout=240)
# (step, name, kvq settings or None for FP32 states, expected decode path); most important first. Names
# ending in _graphs run with GRAPHS (``refused``: start-up must refuse vLLM's default graph mode).
JOBS = [
    ("check", "fp32_state", None, None),
    ("check", "stepquant_mixed", MIXED, "triton"),
    ("check", "stepquant_mixed_graphs", MIXED, "graph"),
    ("check", "uniform_int6_default_graphs", {"state": "uniform", "state_bits": 6}, "refused"),
    ("check", "fp16_pool", {"state": "uniform", "state_bits": 16}, "triton"),
    ("check", "uniform_int6", {"state": "uniform", "state_bits": 6}, "triton"),
    ("speed", "fp32_state", None, None),
    ("speed", "uniform_int6", {"state": "uniform", "state_bits": 6}, "triton"),
    ("check", "stepquant_mixed_refit4", {**MIXED, "state_refit_every": 4}, "triton"),
    ("speed", "uniform_int6_refit4", {"state": "uniform", "state_bits": 6, "state_refit_every": 4}, "triton"),
    ("check", "stepquant_mixed_staged", {**MIXED, **STAGED}, "staged"),
    ("check", "oscar_stepquant_mixed", {**OSCAR, **MIXED}, "triton"),
    ("check", "oscar_stepquant_mixed_graphs", {**OSCAR, **MIXED}, "graph"),
    ("check", "oscar_stepquant_mixed_staged", {**OSCAR, **MIXED, **STAGED}, "staged"),
    ("speed", "uniform_int6_staged", {"state": "uniform", "state_bits": 6, **STAGED}, "staged"),
    ("check", "stepquant_mixed_refit4_graphs", {**MIXED, "state_refit_every": 4}, "graph"),
]


def model_dir(cfg: dict, name: str, weights: bool = False) -> str:
    """A config (vLLM's dummy weights), or with ``weights`` a checkpoint of
    transformers' own random initialisation (std 0.02: activations matter to
    the output; vLLM's dummy weights are too small for that), with every GDN
    head given a long memory. transformers draws the decay rate A from
    U(0.01, 16), so most heads keep e^-20 of their state per token and the
    state's precision barely reaches the output; A from log-U(0.001, 0.1)
    keeps 88-99.9% per token. In transformers' own bf16 forward, quantizing
    the states once (rows, 6 bits) after a 400-token prompt then moves the
    next 16 tokens' log-probabilities by 0.024 on average (by 0.004 with
    transformers' A); FP16 states move them by 0.008, the bf16 logits' own
    rounding."""
    path = Path("/tmp") / name
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if weights and not (path / "model.safetensors").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                a_log = layer.linear_attn.A_log
                a_log.data.copy_(torch.empty(a_log.shape).uniform_(-6.9, -2.3, generator=g))  # ln 0.001, ln 0.1
        model.save_pretrained(path)
    return str(path)


def synthetic_plan(cfg: dict, path: Path) -> str:
    """A STEPQuant plan artifact for ``cfg`` with the widths of PLAN_WIDTHS and
    random impacts (geometric mean 1 per head): it exercises every width, the
    pivots and the impact-weighted fit; it is not a calibrated plan."""
    import torch

    from vllm_kvq.artifacts.fingerprint import gdn_layers, model_fingerprint
    from vllm_kvq.artifacts.stepquant import StepQuantPlan

    hf = types.SimpleNamespace(**cfg)
    layers = gdn_layers(hf)
    hv, kd = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"]
    gen = torch.Generator().manual_seed(0)
    impacts = {}
    for layer in layers:
        w = torch.exp(torch.randn(hv, kd, generator=gen) * 0.4)
        impacts[layer] = w / w.log().mean(-1, keepdim=True).exp()
    if hv % 4:
        raise ValueError(f"synthetic plans repeat widths per 4 value heads, got {hv} heads")
    bits = {b: {layer: widths[i % len(widths)] * (hv // 4) for i, layer in enumerate(layers)}
            for b, widths in PLAN_WIDTHS.items()}
    StepQuantPlan(fingerprint=model_fingerprint(hf), layers=layers, num_v_heads=hv, k_dim=kd,
                  v_dim=cfg["linear_value_head_dim"], budgets=sorted(PLAN_WIDTHS, reverse=True), bits=bits,
                  impacts=impacts, num_k_heads=cfg["linear_num_key_heads"],
                  provenance={"note": "synthetic widths and impacts for the CUDA state check"}).save(path)
    return str(path)


def engine(job: dict) -> dict:
    import vllm_kvq

    vllm_kvq.register()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from evalkit.probe import allocated_state_bytes, count_fused_decodes

    # the bundle has no FlashInfer: vLLM's Triton GDN prefill
    extra = {"gdn_prefill_backend": "triton"}
    kw = {"additional_config": {**extra, "kvq": job["kvq"]} if job["kvq"] else extra}
    if job.get("graphs") == "default":  # vLLM's own default (compiled, FULL_AND_PIECEWISE): must be refused
        try:
            LLM(model=job["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                attention_backend="TRITON_ATTN", gpu_memory_utilization=job["mem"], max_model_len=job["max_len"],
                enable_prefix_caching=False, **kw)
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            return {"refused": f"{type(e).__name__}: {e}"[-400:]}
        return {"refused": None}
    if job.get("graphs"):  # vLLM drops capture sizes above max_num_seqs: keep the largest, the batch pads to it
        kw.update(enforce_eager=False, compilation_config=dict(GRAPHS),
                  max_num_seqs=max(job["batch"], *GRAPHS["cudagraph_capture_sizes"]))
    else:
        kw.update(enforce_eager=True, max_num_seqs=job["batch"])
    if job.get("batched_tokens"):
        kw["max_num_batched_tokens"] = job["batched_tokens"]
    fmt = "auto" if (Path(job["model"]) / "model.safetensors").exists() else "dummy"
    backend = "OSCAR" if "rotation" in (job["kvq"] or {}) else "TRITON_ATTN"
    llm = LLM(model=job["model"], load_format=fmt, skip_tokenizer_init=True, dtype="bfloat16",
              attention_backend=backend, mamba_ssm_cache_dtype="float32",
              gpu_memory_utilization=job["mem"], max_model_len=job["max_len"], enable_prefix_caching=False, seed=0,
              **kw)
    llm.apply_model(count_fused_decodes)
    g = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, 8000, (job["prompt_len"],), generator=g).tolist())
               for _ in range(job["requests"])]
    params = SamplingParams(max_tokens=job["gen"], temperature=0, logprobs=2 if job["logprobs"] else None,
                            ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)  # warm-up, compiles
    res = {}
    if not job["logprobs"]:  # the prefill's share: the same prompts, one output token
        t = time.time()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        res["prefill_wall_s"] = time.time() - t
    calls = lambda layers: max([x["triton_calls"] for x in layers], default=0)  # noqa: E731
    before = calls(llm.apply_model(allocated_state_bytes)[0])
    t = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.time() - t
    res.update(wall_s=wall, tok_s=job["requests"] * job["gen"] / wall)
    if "prefill_wall_s" in res and wall > res["prefill_wall_s"]:
        res["decode_tok_s"] = job["requests"] * (job["gen"] - 1) / (wall - res["prefill_wall_s"])
    if job["logprobs"]:
        res.update(record(outs))
    layers = llm.apply_model(allocated_state_bytes)[0]
    res["triton_calls_in_job"] = calls(layers) - before  # decode steps that ran the step from Python, not a graph
    packed = [x for x in layers if x["bits"] is not None]
    if packed:
        used = {x["triton_calls"] > 0 for x in packed}
        path = "mixed" if len(used) > 1 else ("triton" if used.pop() else "staged")
        # captures run before the count starts, so a graph engine's decode makes no Python call at all;
        # which step its graphs hold shows in its distance from its eager twin (graphs_match_eager)
        res["decode_path"] = "graph" if job.get("graphs") and path == "staged" else path
        res["triton_calls_per_layer"] = max(x["triton_calls"] for x in packed)
        res["mixed_calls_per_layer"] = max(x["mixed_calls"] for x in packed)  # mixed batches' decode rows
    res["state_page_bytes"] = sum(x["page_bytes"] for x in layers)
    return res


def read_result(path: Path) -> dict:
    """An engine's result from its JSON, its record's token ids restored."""
    res = json.loads(path.read_text())
    return from_json(res) if "logprobs" in res else res


def run(name: str, job: dict) -> dict:
    """One engine in its own process; a failure or timeout comes back as ``error``."""
    path = OUT / f"state_{name}.json"
    log = OUT / f"state_{name}.log"
    path.unlink(missing_ok=True)
    env = dict(os.environ, KVQ_STATE_JOB=json.dumps(job), KVQ_STATE_OUT=str(path),
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # apply_model ships a function
    t = time.time()
    with log.open("w") as f:
        try:
            proc = subprocess.run([sys.executable, "-m", "scripts.cuda_state_check", "--engine"], env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=job["timeout"])
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    took = time.time() - t
    if rc == 0 and path.exists():
        res = read_result(path)
        path.unlink()
        res["engine_s"] = took
        return res
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-25:]
    why = f"timed out after {job['timeout']} s" if rc == "timeout" else f"exit code {rc}"
    at = next((i for i in range(len(tail) - 1, -1, -1) if "Error" in tail[i] or "Exception" in tail[i]), None)
    last = "" if at is None else " ".join(line.strip() for line in tail[at : at + 2])
    return {"error": f"engine {why}: {last[:300]} (log: {log})", "log_tail": tail, "engine_s": took}


def summarize(report: dict, results: dict) -> None:
    """Comparisons, speed ratios and the verdict from the engines run so far."""
    check, speed = report.get("check"), report.get("speed")
    problems = report["problems"] = []
    for (step, name), r in results.items():
        want = next(e for s, n, _, e in JOBS if (s, n) == (step, name))
        if "error" in r:
            problems.append(f"{step} {name}: {r['error']}")
        elif want == "refused":
            if "FULL_DECODE_ONLY" not in (r.get("refused") or ""):
                problems.append(f"{step} {name}: start-up did not refuse vLLM's default graph mode: {r}")
        elif r.get("decode_path") != want:
            problems.append(f"{step} {name}: decode path {r.get('decode_path')!r}, expected {want!r}")
        elif step == "check" and want == "triton" and not r.get("mixed_calls_per_layer"):
            problems.append(f"{step} {name}: no mixed batch's decode rows took the split step")
    if check is not None:
        ref = results.get(("check", "fp32_state"), {})
        for (step, name), r in results.items():
            if step != "check":
                continue
            keys = ("decode_path", "triton_calls_per_layer", "mixed_calls_per_layer", "triton_calls_in_job",
                    "state_page_bytes", "engine_s",
                    "from_earlier_call", "refused", "error")
            entry = check[name] = {k: r[k] for k in keys if k in r}
            if "logprobs" in r:  # for reading the comparisons by eye
                entry["first_prompt_first_steps"] = r["logprobs"][0][:3]
            if "error" in r or "refused" in r or name == "fp32_state":
                continue
            if "tokens" in ref:
                entry["vs_fp32"] = compare(r, ref)
            twin = results.get(("check", name + "_staged"))
            if twin and "tokens" in twin:
                entry["vs_staged"] = compare(r, twin)
            eager = results.get(("check", name.removesuffix("_graphs"))) if name.endswith("_graphs") else None
            bf16_attention = results.get(("check", name.removeprefix("oscar_"))) if name.startswith("oscar_") else None
            if bf16_attention and "tokens" in bf16_attention:
                entry["vs_bf16_attention"] = compare(r, bf16_attention)
            if eager and "tokens" in eager:
                entry["vs_eager"] = compare(r, eager)
        verdict = {}
        if "vs_fp32" in check.get("fp16_pool", {}):
            verdict["fp16_pool_matches_fp32"] = check["fp16_pool"]["vs_fp32"]["dlogprob_mean"] < 0.01
        if "vs_fp32" in check.get("uniform_int6", {}):  # the control: a check blind to INT6 states proves nothing
            verdict["int6_state_error_visible"] = check["uniform_int6"]["vs_fp32"]["dlogprob_max"] > 0
        if "vs_staged" in check.get("stepquant_mixed", {}):
            verdict["triton_decode_matches_staged"] = check["stepquant_mixed"]["vs_staged"]["dlogprob_mean"] < 0.01
        held, plain = check.get("stepquant_mixed_refit4", {}), check.get("stepquant_mixed", {})
        if "vs_fp32" in held and "vs_fp32" in plain:  # held updates round the state less often: no further from FP32
            verdict["held_updates_no_worse"] = held["vs_fp32"]["dlogprob_mean"] <= 1.1 * plain["vs_fp32"]["dlogprob_mean"]
        for tag, name in (("graphs", "stepquant_mixed_graphs"), ("oscar_graphs", "oscar_stepquant_mixed_graphs"),
                          ("held_graphs", "stepquant_mixed_refit4_graphs")):
            graphs = check.get(name, {})
            if "vs_eager" in graphs:
                verdict[f"{tag}_match_eager"] = graphs["vs_eager"]["dlogprob_mean"] < GRAPH_BOUND
            if "triton_calls_in_job" in graphs:  # every decode step of the job replayed a graph
                verdict[f"{tag}_replayed"] = graphs["triton_calls_in_job"] == 0
        oscar = check.get("oscar_stepquant_mixed", {})
        if "vs_staged" in oscar:  # OSCAR's Triton kernels against its reference ops, the pool the same
            verdict["oscar_triton_matches_reference"] = oscar["vs_staged"]["dlogprob_mean"] < 0.03
        if "vs_bf16_attention" in oscar:  # the control: a check blind to INT2 attention proves nothing
            verdict["oscar_int2_visible"] = oscar["vs_bf16_attention"]["dlogprob_max"] > 0
        check["ok"] = bool(verdict) and all(verdict.values()) and not any(p.startswith("check") for p in problems)
        check["verdict"] = verdict
    if speed is not None:
        base = results.get(("speed", "fp32_state"), {})
        for (step, name), r in results.items():
            if step != "speed":
                continue
            keys = ("tok_s", "decode_tok_s", "wall_s", "prefill_wall_s", "decode_path", "state_page_bytes",
                    "engine_s", "from_earlier_call", "error")
            entry = speed[name] = {k: r[k] for k in keys if k in r}
            twin = results.get(("speed", name + "_staged"), {})
            for k in ("tok_s", "decode_tok_s"):
                if name != "fp32_state" and k in r and k in base:
                    entry[f"{k}_vs_fp32"] = r[k] / base[k]
                if k in r and k in twin:
                    entry[f"{k}_vs_staged"] = r[k] / twin[k]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("steps", nargs="*", choices=["check", "speed"], help="default: both")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no engine past this many seconds")
    ap.add_argument("--only", nargs="*", help="run only these engines (JOBS names)")
    ap.add_argument("--keep", type=Path, help="keep finished engines' results here; reuse those already here")
    args = ap.parse_args()
    keep = args.keep
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    steps = args.steps or ["check", "speed"]
    OUT.mkdir(parents=True, exist_ok=True)
    start = time.time()
    import torch

    report: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "date": time.strftime("%Y-%m-%d")}
    if "check" in steps:
        report["check"] = {"config": {k: SMALL[k] for k in ("hidden_size", "num_hidden_layers",
                                                             "linear_num_value_heads")},
                           **{k: CHECK[k] for k in ("requests", "prompt_len", "gen")},
                           "stepquant_mixed_widths_at_6": ["/".join(map(str, w)) for w in PLAN_WIDTHS[6]]}
    if "speed" in steps:
        report["speed"] = {"config": {k: LARGE[k] for k in ("hidden_size", "num_hidden_layers",
                                                             "linear_num_value_heads")},
                           **{k: SPEED[k] for k in ("requests", "prompt_len", "gen")}}
    models, results = {}, {}
    out = OUT / "cuda_state_check.json"
    for step, name, kvq, _ in JOBS:
        if step not in steps or (args.only and name not in args.only):
            continue
        base = CHECK if step == "check" else SPEED
        kept = keep / f"{step}_{name}.json" if keep else None
        left = args.budget_s - (time.time() - start)
        if kept and kept.exists():
            r = results[(step, name)] = {**read_result(kept), "from_earlier_call": True}
        elif left < 90:
            results[(step, name)] = {"error": f"skipped ({left:.0f} s of the time budget left)"}
            continue
        else:
            r = results[(step, name)] = run_job(step, name, base, kvq, int(left), models)
            if kept and "error" not in r:
                kept.write_text(json.dumps(r))
        shown = {k: v for k, v in r.items() if k not in ("tokens", "logprobs", "log_tail")}
        print(step, name, json.dumps(shown), flush=True)
        if "log_tail" in r:
            print("\n".join(r["log_tail"]), flush=True)
        summarize(report, results)
        out.write_text(json.dumps(report, indent=1) + "\n")
    summarize(report, results)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("problems:", report["problems"] or "none", flush=True)


def run_job(step: str, name: str, base: dict, kvq: dict | None, left: int, models: dict) -> dict:
    """Set up the job's model (and plan) once per call, then run its engine in its own process."""
    try:
        if base["model"] not in models:
            models[base["model"]] = (model_dir(SMALL, "kvq_gdn_small_long_memory", weights=True)
                                     if base["model"] == "small" else model_dir(LARGE, "kvq_gdn_large"))
        if kvq and kvq.get("state_artifact") == "PLAN":
            if "plan" not in models:
                models["plan"] = synthetic_plan(SMALL, Path("/tmp") / "kvq_gdn_small_plan")
            kvq = {**kvq, "state_artifact": models["plan"]}
    except Exception as e:  # noqa: BLE001 - reported, the other engines still run
        return {"error": f"setup failed: {e!r}"}
    graphs = "default" if name.endswith("_default_graphs") else name.endswith("_graphs")
    job = {**base, "model": models[base["model"]], "kvq": kvq, "graphs": graphs,
           "timeout": min(base["timeout"], left - 10)}
    return run(f"{step}_{name}", job)


if __name__ == "__main__":
    if "--engine" in sys.argv:
        result = engine(json.loads(os.environ["KVQ_STATE_JOB"]))
        Path(os.environ["KVQ_STATE_OUT"]).write_text(json.dumps(result))
    else:
        main()
