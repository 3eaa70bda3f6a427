"""Pack house-qwen3, its tokenizer and tokenized prompts small enough to travel
to a GPU machine.

A trained model is needed for the CUDA token-equality check: a random-weight
model predicts near-uniformly, so any rounding difference flips greedy ties.
house-qwen3 is 43 MB in bf16; its large matrices are stored here as int8 with
one fp16 scale per row (22 MB) and restored to bf16 on the GPU machine by
``scripts/cuda_check.py``. The restored model is a slightly different (still
trained, still confident) model; both backends run the same restored weights.

    python -m scripts.pack_for_gpu OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from evalkit.data import MODELS, code_text, tokenizer

MODEL = MODELS / "house-qwen3"


def pack_weights(out: Path) -> None:
    packed = {}
    for name, w in load_file(MODEL / "model.safetensors").items():
        if w.dim() == 2 and w.numel() >= 1 << 16:
            scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
            packed[name + ".int8"] = (w.float() / scale).round().to(torch.int8)
            packed[name + ".scale"] = scale.half()
        else:
            packed[name] = w
    save_file(packed, out / "model.int8.safetensors")
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / f, out / f)


def pack_prompts(out: Path) -> None:
    """48 short prompts (exact check) and 8 of 1500 tokens (INT2 active) from the dev data."""
    ids = tokenizer(str(MODEL))(code_text()[:400_000])["input_ids"]
    short = [ids[i * 1200 : i * 1200 + 200] for i in range(48)]
    long = [ids[60_000 + i * 5000 : 60_000 + i * 5000 + 1500] for i in range(8)]
    (out / "prompts.json").write_text(json.dumps({"short": short, "long": long}))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    pack_weights(out)
    pack_prompts(out)
    print(f"packed into {out}: {sum(f.stat().st_size for f in out.iterdir()) / 2**20:.1f} MiB")
