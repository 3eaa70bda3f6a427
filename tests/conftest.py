"""Shared helpers: the house models, small vLLM engines on CPU, and one engine
per configuration for the whole session (:func:`engines`)."""

import gc
import json
import os
from collections import OrderedDict

import pytest
import torch

from evalkit.data import CODE, MODELS, REPO, model_path, needles, tokenizer_path  # noqa: F401  (test modules import them)

EVAL = CODE.parent  # the development data: code-dev.txt.gz, needles-dev.jsonl

os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model ships the tests' probes
# vLLM's default pins each engine's OpenMP threads and keeps a core for its
# scheduler: on two cores an engine would compute on one
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter. Triton picks
    # the mode when a kernel is defined, so this must hold before any test
    # module (collected in any order) imports a kernel module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

ENGINES_ALIVE = 3  # engines kept for later tests; each holds its KV cache, weights and processes


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
    if tokenizer_path(model) != args["model"]:
        args["tokenizer"] = tokenizer_path(model)
    if oscar is not None:
        args.update(attention_backend="OSCAR", additional_config={"kvq": oscar})
    args.update(kwargs)
    return args


def make_llm(model: str = "house-qwen3", oscar: dict | None = None, **kwargs):
    """A small CPU engine (:func:`engine_args`) of the caller's own; shut it
    down with :func:`shutdown`."""
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


class Engines:
    """Engines shared by every test of the session: the same arguments give
    the same engine. At most ``limit`` stay alive; the least recently used
    is shut down to make room."""

    def __init__(self, limit: int):
        self.limit = limit
        self.alive: OrderedDict = OrderedDict()

    def __call__(self, model: str = "house-qwen3", oscar: dict | None = None, **kwargs):
        key = json.dumps(engine_args(model, oscar, **kwargs), sort_keys=True, default=str)
        llm = self.alive.pop(key, None)
        if llm is None:
            while len(self.alive) >= self.limit:
                shutdown(self.alive.popitem(last=False)[1])
            llm = make_llm(model, oscar, **kwargs)
        self.alive[key] = llm
        return llm

    def close(self) -> None:
        while self.alive:
            shutdown(self.alive.popitem()[1])


@pytest.fixture(scope="session")
def engines():
    """``engines(model, oscar, **kwargs)``: the session's engine of that
    configuration (:func:`engine_args`), started on first use."""
    cache = Engines(ENGINES_ALIVE)
    yield cache
    cache.close()


@pytest.fixture(scope="session")
def greedy():
    from vllm import SamplingParams

    def params(max_tokens: int = 16, **kw):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)

    return params
