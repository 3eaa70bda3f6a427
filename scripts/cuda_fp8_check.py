"""OSCAR on an FP8 checkpoint in real vLLM on CUDA (the GLM-4.7-FP8 path).

house-qwen3 (restored to bf16 as in ``cuda_check.py``) is written as a
block-quantized FP8 checkpoint (128 x 128 blocks, fp32 ``weight_scale_inv``,
the layout of DeepSeek/GLM FP8 checkpoints) and served with TRITON_ATTN and
with OSCAR (Hadamard, sink + window >= prompt length, so no INT2 is read):
R_V is folded into the FP8 ``v_proj`` rows and ``o_proj`` columns with
requantization (``backends/fp8_weights.py``), so the two runs differ only by
that requantization. Results: ``$OUT/cuda_fp8_check.json``.

    python -m scripts.cuda_fp8_check
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from evalkit.compare import compare

FP8_DIR = Path("/tmp/kvq_cuda_fp8_model")
os.environ["KVQ_CUDA_MODEL"] = str(FP8_DIR)
from scripts import cuda_check  # noqa: E402  (reads KVQ_CUDA_MODEL)

BLOCK = 128
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_fp8_model() -> None:
    import torch
    from safetensors.torch import load_file, save_file

    bf16_dir = Path("/tmp/kvq_cuda_model")
    cuda_check.MODEL_DIR = bf16_dir
    cuda_check.make_model()
    weights = load_file(bf16_dir / "model.safetensors")
    out = {}
    for name, w in weights.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            rows, cols = w.shape
            blocks = w.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
            scale = (blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-12)
            codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
            out[name] = codes
            out[name + "_scale_inv"] = scale.float().contiguous()
        else:
            out[name] = w
    FP8_DIR.mkdir(parents=True, exist_ok=True)
    save_file(out, FP8_DIR / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (FP8_DIR / "config.json").write_text(json.dumps(config))
    (FP8_DIR / "generation_config.json").write_text((bf16_dir / "generation_config.json").read_text())


def main() -> None:
    out_dir = cuda_check.OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    make_fp8_model()
    runs = {"fp8_bf16_kv": ("TRITON_ATTN", "{}"), "fp8_oscar_hadamard": ("OSCAR", json.dumps({"rotation": "hadamard"}))}
    results = {}
    for name, (backend, kvq) in runs.items():
        path = FP8_DIR.parent / f"kvq_cuda_{name}.json"
        subprocess.run([sys.executable, "-m", "scripts.cuda_check", "engine", backend, kvq, str(path)], check=True,
                       env=dict(os.environ, KVQ_CUDA_MODEL=str(FP8_DIR)))
        results[name] = cuda_check.read_run(path)
    summary = {"compare_200_tokens": compare(results["fp8_oscar_hadamard"]["short"], results["fp8_bf16_kv"]["short"]),
               "kv_cache_size_tokens": {n: r["kv_cache_size_tokens"] for n, r in results.items()}}
    (out_dir / "cuda_fp8_check.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
