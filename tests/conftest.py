"""Shared helpers: the vendored house models and small vLLM engines on CPU."""

import gc
import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "examples" / "models"
EVAL = REPO.parent / "shared" / "eval"

os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter. Triton picks
    # the mode when a kernel is defined, so this must hold before any test
    # module (collected in any order) imports a kernel module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def model_path(name: str = "house-qwen3") -> str:
    return str(MODELS / name)


def needles(max_tokens: int = 4096, limit: int | None = None, min_tokens: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in (EVAL / "needles-dev.jsonl").open()]
    rows = [r for r in rows if min_tokens <= r["prompt_tokens"] <= max_tokens]
    return rows[:limit] if limit else rows


def engine_args(model: str = "house-qwen3", oscar: dict | None = None, **kwargs) -> dict:
    """The arguments of a small CPU engine; ``oscar`` (the kvq settings)
    selects the OSCAR backend."""
    args = dict(
        model=model_path(model),
        max_model_len=4096,
        max_num_seqs=16,
        enforce_eager=True,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,
        seed=0,
    )
    if model == "house-qwen2":
        args["tokenizer"] = str(MODELS / "house-qwen2" / "tokenizer")
    if oscar is not None:
        args.update(attention_backend="OSCAR", additional_config={"kvq": oscar})
    args.update(kwargs)
    return args


def make_llm(model: str = "house-qwen3", oscar: dict | None = None, **kwargs):
    """A small CPU engine (:func:`engine_args`)."""
    from vllm import LLM

    return LLM(**engine_args(model, oscar, **kwargs))


def engine_config(model: str = "house-qwen3", oscar: dict | None = None, **kwargs):
    """The VllmConfig such an engine would get, with every start-up check run,
    without starting the engine."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_kvq

    vllm_kvq.register()
    return EngineArgs(**engine_args(model, oscar, **kwargs)).create_engine_config()


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def greedy():
    from vllm import SamplingParams

    def params(max_tokens: int = 16, **kw):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)

    return params
