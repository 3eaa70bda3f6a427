"""Wall time of ``vllm-kvq calibrate``, the whole command (process start,
imports, tokenization, checkpoint load, capture, fitting, writing the artifact).

    python -m benchmarks.calibration_time                 # house-qwen3 on CPU
    python -m benchmarks.calibration_time --random-shape qwen3-8b --device cuda \\
        --dtype bfloat16 --tokenizer DIR --data FILE      # a GPU at Qwen3-8B shape

The second form first writes a random-weight checkpoint of that shape (weights
do not change the work; the time to write it is not counted). Results are
merged into ``benchmarks/results/calibration-time.json`` (one row per model,
device and clip); ``benchmarks.accuracy`` renders them into docs/accuracy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from evalkit.data import CODE, REPO

RESULTS = REPO / "benchmarks" / "results" / "calibration-time.json"

SHAPES = {  # transformers Qwen3 config fields of the published checkpoints
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def random_checkpoint(shape: str, out: Path, device: str) -> Path:
    """A random-weight Qwen3 checkpoint of a published shape, in bf16."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], torch_dtype="bfloat16")
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    return out


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores)"


def time_calibrate(model: str, data: str, clip: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "vllm_kvq.cli", "calibrate", model, "--data", data,
               "--out", f"{tmp}/a", "--clip", clip, *extra]
        load = os.getloadavg()[0]
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.time() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        prov = json.loads((Path(tmp) / "a" / "manifest.json").read_text())["provenance"]
    return {"clip": clip, "wall_s": round(wall, 1), "inside_s": prov["seconds"], "tokens": prov["tokens"],
            "cpu_s": round(cpu, 1), "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(), "dtype": prov["dtype"], "date": time.strftime("%Y-%m-%d")}


def merge(rows: list[dict]) -> None:
    """Replace the saved rows of the same (model, device, clip), keep the others."""
    key = lambda r: (r["model"], r.get("device", "CPU"), r["clip"])  # noqa: E731
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    new = {key(r) for r in rows}
    RESULTS.write_text(json.dumps([r for r in old if key(r) not in new] + rows, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="examples/models/house-qwen3")
    ap.add_argument("--random-shape", choices=sorted(SHAPES), help="time a random-weight model of this shape")
    ap.add_argument("--tokenizer", help="tokenizer directory (needed with --random-shape)")
    ap.add_argument("--data", default=str(CODE))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clips", nargs="*", default=["fixed"])
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()
    extra = ["--device", a.device, "--dtype", a.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        model, name = a.model, Path(a.model).name
        if a.random_shape:
            if not a.tokenizer:
                ap.error("--random-shape needs --tokenizer")
            t0 = time.time()
            model = str(random_checkpoint(a.random_shape, Path(tmp) / a.random_shape, a.device))
            print(f"wrote a random {a.random_shape} checkpoint in {time.time() - t0:.0f} s", flush=True)
            name = f"{a.random_shape} (random weights)"
        if a.tokenizer:
            extra += ["--tokenizer", a.tokenizer]
        rows = []
        for clip in a.clips:
            r = {"model": name, "device": device_name(a.device), **time_calibrate(model, a.data, clip, extra)}
            print(json.dumps(r), flush=True)
            rows.append(r)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    merge(rows)


if __name__ == "__main__":
    main()
