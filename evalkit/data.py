"""The development data and the house models, in one place for tests,
benchmarks and scripts: needles (by prompt length and length bucket),
perplexity windows of the held-out code, and each model's tokenizer."""

from __future__ import annotations

import gzip
import json
import math
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "examples" / "models"
CODE = Path(__file__).with_name("data") / "code-dev.txt.gz"
NEEDLES = CODE.with_name("needles-dev.jsonl")
# prompt-length buckets of the needle scores: (lowest, past the highest, name)
BUCKETS = [(0, 1024, "<1k"), (1024, 2048, "1-2k"), (2048, 3072, "2-3k"), (3072, 4097, "3-4k")]


def model_path(name: str = "house-qwen3") -> str:
    """A house model's directory (a path is returned as it is)."""
    return str(MODELS / name) if (MODELS / name).is_dir() else name


def tokenizer_path(model: str = "house-qwen3") -> str:
    """Where a model's tokenizer lives: its ``tokenizer/`` folder if it has
    one (house-qwen2), else the model directory."""
    path = Path(model_path(model))
    return str(path / "tokenizer") if (path / "tokenizer").is_dir() else str(path)


def tokenizer(model: str = "house-qwen3"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path(model))


@lru_cache(maxsize=1)
def _needle_rows() -> tuple[dict, ...]:
    return tuple(json.loads(line) for line in NEEDLES.open())


def needles(max_tokens: int = 4096, limit: int | None = None, min_tokens: int = 0) -> list[dict]:
    """Needle prompts of ``min_tokens`` to ``max_tokens`` tokens, in file order."""
    rows = [dict(r) for r in _needle_rows() if min_tokens <= r["prompt_tokens"] <= max_tokens]
    return rows[:limit] if limit else rows


def needle_set(per_bucket: int, buckets: list = BUCKETS) -> list[dict]:
    """The first ``per_bucket`` needles of each prompt-length bucket."""
    return [r for lo, hi, _ in buckets for r in needles(hi - 1, min_tokens=lo)[:per_bucket]]


def needle_scores(texts: list[str], rows: list[dict], buckets: list = BUCKETS) -> dict:
    """Hits (a continuation starting with the answer's first 4 characters),
    their rate overall and per bucket."""
    hits = [t.startswith(r["answer"][:4]) for t, r in zip(texts, rows)]
    by_bucket = {}
    for lo, hi, name in buckets:
        sel = [h for h, r in zip(hits, rows) if lo <= r["prompt_tokens"] < hi]
        by_bucket[name] = sum(sel) / len(sel) if sel else float("nan")
    return {"hits": hits, "needle_acc": sum(hits) / len(hits), "needle_by_bucket": by_bucket}


def code_text() -> str:
    return gzip.open(CODE, "rt").read()


def ppl_windows(tok, count: int, length: int = 4000) -> list[list[int]]:
    """The first ``count`` windows of ``length`` tokens of the held-out code."""
    ids = tok(code_text()[: 400 * length * count])["input_ids"]
    return [ids[i * length: (i + 1) * length] for i in range(count) if (i + 1) * length <= len(ids)]


def perplexity(outputs, windows: list[list[int]]) -> tuple[float, int]:
    """(perplexity, tokens scored) of windows scored with ``prompt_logprobs``
    (every token but the first)."""
    nll, n = 0.0, 0
    for out, window in zip(outputs, windows):
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            nll -= entry[window[i]].logprob
            n += 1
    return math.exp(nll / n), n
