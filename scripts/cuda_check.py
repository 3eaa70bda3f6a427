"""The OSCAR backend in real vLLM on CUDA (reference ops on CUDA tensors).

Runs on a GPU machine with vLLM 0.32 (``bash scripts/h200.sh check`` runs
``python -m scripts.cuda_check``):

1. the reference ops give the same bytes and outputs on CUDA as on CPU;
2. house-qwen3 (carried int8, restored to bf16: scripts/pack_for_gpu.py)
   generates with TRITON_ATTN and with OSCAR (Hadamard through the Triton
   kernels, Hadamard through the reference ops on CUDA tensors, the bundled
   calibrated artifact, and the bundled tiered artifact through the Triton
   kernels and through the reference ops) at the default sink 64 / window
   256; on 200-token prompts (sink + window >= length) the greedy tokens of
   the Hadamard and tiered runs must be equal to BF16's up to BF16's first
   near tie (``evalkit.compare``) in every prompt; whole sequences are
   reported too;
3. on 1500-token prompts (quantized rows read) the distance to BF16 is
   reported, and the tiered Triton run must equal the tiered reference run
   up to that run's first near tie.

Each engine runs in its own process. Results go to ``$OUT/cuda_check.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from evalkit.compare import compare, from_json, record
from evalkit.data import REPO

MODEL_DIR = Path(os.environ.get("KVQ_CUDA_MODEL", "/tmp/kvq_cuda_model"))
OUT = Path(os.environ.get("OUT", "/tmp/kvq_out"))
CARRY = REPO / ".device-carry" / "house-qwen3"
# the runs whose 200-token prompts must equal BF16's up to its first near tie
EXACT_RUNS = ("oscar_hadamard", "oscar_reference_ops", "oscar_tiered", "oscar_tiered_reference_ops")


def make_model() -> None:
    """Restore the int8-packed house-qwen3 (scripts/pack_for_gpu.py) to bf16."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    packed = load_file(CARRY / "model.int8.safetensors")
    weights = {}
    for name, t in packed.items():
        if name.endswith(".int8"):
            base = name[: -len(".int8")]
            weights[base] = (t.float() * packed[base + ".scale"].float()).to(torch.bfloat16)
        elif not name.endswith(".scale"):
            weights[name] = t
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    save_file(weights, MODEL_DIR / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        shutil.copy(CARRY / f, MODEL_DIR / f)


def prompts(kind: str) -> list[list[int]]:
    return json.loads((CARRY / "prompts.json").read_text())[kind]


def run_engine(backend: str, kvq: str, out: str) -> None:
    import vllm_kvq

    vllm_kvq.register()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"attention_backend": backend}
    if backend == "OSCAR":
        kw["additional_config"] = {"kvq": json.loads(kvq)}
    llm = LLM(model=str(MODEL_DIR), skip_tokenizer_init=True, max_model_len=4096, gpu_memory_utilization=0.3,
              enforce_eager=True, enable_prefix_caching=False, block_size=128, seed=0, **kw)
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=2, detokenize=False)
    result = {"kv_cache_size_tokens": llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens}
    for kind in ("short", "long"):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(kind)], params, use_tqdm=False)
        result[kind] = record(outs)
    Path(out).write_text(json.dumps(result))


def read_run(path: Path) -> dict:
    """One engine's results, its records with token ids restored."""
    res = json.loads(path.read_text())
    return {k: from_json(v) if isinstance(v, dict) and "tokens" in v else v for k, v in res.items()}


def check_ops() -> dict:
    import torch

    from vllm_kvq.kernels.oscar import reference as ref
    from vllm_kvq.kernels.oscar.format import LayerTiers, OscarFormat

    out = {}
    for name, tiers in (("int2", None), ("tiers", LayerTiers.parse("k=48x4,80x2;v=16x4,48x2,64x0"))):
        torch.manual_seed(0)
        fmt = OscarFormat(head_size=128, block_size=128, sink=16, window=64, tiers=tiers)
        n, h, g = 700, 8, 4
        q, k, v = torch.randn(n, h * g, 128), torch.randn(n, h, 128), torch.randn(n, h, 128)
        fill = (None, torch.randn(h, fmt.v.zero) if fmt.v.zero else None)
        row = torch.arange(1, 1 + fmt.state_blocks + 6, dtype=torch.int32)
        res = {}
        for dev in ("cpu", "cuda"):
            cache = torch.zeros(32, h, 128, fmt.bytes_per_token, dtype=torch.uint8, device=dev)
            fills = tuple(None if f is None else f.to(dev) for f in fill)
            outs, start = [], 0
            for size in (300, 64, 1, 335):
                outs.append(ref.attend_and_write(ref.PageViews(cache, fmt), fmt, row.to(dev), start,
                                                 q[start:start + size].to(dev), k[start:start + size].to(dev),
                                                 v[start:start + size].to(dev), 0.96, 0.92, 0.088, fills))
                start += size
            res[dev] = (cache.cpu(), torch.cat(outs).cpu())
        data = row[fmt.state_blocks:].long()
        out[f"{name}_pages_identical_cpu_vs_cuda"] = bool(torch.equal(res["cpu"][0][data], res["cuda"][0][data]))
        out[f"{name}_max_abs_output_diff_cpu_vs_cuda"] = (res["cpu"][1] - res["cuda"][1]).abs().max().item()
    out["pages_identical_cpu_vs_cuda"] = out["int2_pages_identical_cpu_vs_cuda"] and out[
        "tiers_pages_identical_cpu_vs_cuda"]
    return out


def summarize(ops: dict, results: dict, device: str, date: str) -> dict:
    """The check's verdict from the engines' runs (``results`` by run name)."""
    base = results["bf16"]
    summary = {"device": device, "date": date, "ops": ops,
               "bf16": {"kv_cache_size_tokens": base["kv_cache_size_tokens"]}}
    for name in [n for n in results if n != "bf16"]:
        r = results[name]
        summary[name] = {"kv_cache_size_tokens": r["kv_cache_size_tokens"],
                         "capacity_vs_bf16": r["kv_cache_size_tokens"] / base["kv_cache_size_tokens"],
                         "exact_200_tokens": compare(r["short"], base["short"]),
                         "int2_1500_tokens": compare(r["long"], base["long"])}
    exact_runs = [summary[n]["exact_200_tokens"] for n in EXACT_RUNS if n in results]
    summary["exact_ok"] = (bool(exact_runs) and ops["pages_identical_cpu_vs_cuda"]
                           and all(x["tokens_compared"] >= 128 and x["equal_up_to_tie"] == x["prompts"]
                                   for x in exact_runs))
    if {"oscar_tiered", "oscar_tiered_reference_ops"} <= set(results):
        tiered = summary["tiered_triton_vs_reference_long"] = compare(
            results["oscar_tiered"]["long"], results["oscar_tiered_reference_ops"]["long"])
        summary["exact_ok"] = summary["exact_ok"] and tiered["equal_up_to_tie"] == tiered["prompts"]
    return summary


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        run_engine(*sys.argv[2:6])
        return
    import torch

    OUT.mkdir(parents=True, exist_ok=True)
    ops = check_ops()
    print("ops:", ops, flush=True)
    make_model()
    artifacts = REPO / "examples" / "artifacts"
    tiered = str(artifacts / "house-qwen3-auto80")  # the default: the plan calibration chose at 80 B
    runs = {
        "bf16": ("TRITON_ATTN", "{}"),
        "oscar_hadamard": ("OSCAR", json.dumps({"rotation": "hadamard"})),
        "oscar_reference_ops": ("OSCAR", json.dumps({"rotation": "hadamard", "kernels": "reference"})),
        "oscar_calibrated": ("OSCAR", json.dumps({"artifact": str(artifacts / "house-qwen3-oscar")})),
        "oscar_tiered": ("OSCAR", json.dumps({"artifact": tiered})),
        "oscar_tiered_reference_ops": ("OSCAR", json.dumps({"artifact": tiered, "kernels": "reference"})),
    }
    if len(sys.argv) > 1:  # a subset, e.g. ``bf16 oscar_hadamard``
        runs = {name: runs[name] for name in sys.argv[1:]}
    results = {}
    for name, (backend, kvq) in runs.items():
        path = MODEL_DIR.parent / f"kvq_cuda_{name}.json"
        subprocess.run([sys.executable, "-m", "scripts.cuda_check", "engine", backend, kvq, str(path)], check=True)
        results[name] = read_run(path)
        (OUT / path.name).write_text(path.read_text())
    summary = summarize(ops, results, torch.cuda.get_device_name(0), time.strftime("%Y-%m-%d"))
    (OUT / "cuda_check.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    if not summary["exact_ok"]:
        raise SystemExit("CUDA check failed")


if __name__ == "__main__":
    main()
