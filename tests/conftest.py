"""Shared helpers: the house models, small vLLM engines on CPU, and the
session's engine of a configuration, kept for the tests that follow
(:func:`engines`).

Engines run inside the test process (vLLM's in-process engine core and
single-process executor): no engine-core and worker processes to start, and
no engine core spinning on its worker's replies while the worker computes,
which on two cores costs more than the model does. vLLM keeps one distributed
state per process and an engine's shutdown tears it down, so one engine is
alive at a time: starting one shuts the kept one down first. Tests that need
vLLM's processes (tensor parallelism, the server) set
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` for their engines; ngram engines always
get them (:func:`make_llm`)."""

import gc
import json
import os

import pytest

# Every engine here runs eagerly (enforce_eager); what torch.compile would
# still build is vLLM's logprob gather, with inductor, in every process that
# asks for logprobs: ~7 s a process on two cores, for the same results. Set
# before torch is imported; engine processes inherit it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
import torch  # noqa: E402

from evalkit.data import CODE, MODELS, REPO, model_path, needles, tokenizer_path  # noqa: F401  (test modules import them)

EVAL = CODE.parent  # the development data: code-dev.txt.gz, needles-dev.jsonl

os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model ships the tests' probes
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's default pins each engine's OpenMP threads and keeps a core for its
# scheduler: on two cores an engine would compute on one
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# One intra-op thread, as vLLM serves on CPU: an in-process engine's worker
# replaces torch.set_num_threads with a no-op before it would lower the count,
# and two threads spin-waiting on two shared cores make every step several times
# slower. make_llm puts the real function back after each start.
SET_NUM_THREADS = torch.set_num_threads
torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter. Triton picks
    # the mode when a kernel is defined, so this must hold before any test
    # module (collected in any order) imports a kernel module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_language_once_per_launch():
    """Triton's interpreter patches ``triton.language`` for the interpreter
    when a kernel launches, and again at every call of a nested ``@jit``
    function (~30% of an interpreted engine step's profile here), though the patches,
    set on the module objects, still hold there. In this process a nested
    call patches only modules the launch has not (``tl.min``'s module sees
    ``tl.core``, a kernel ``tl``), and the launch restores all at its end."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch, launches = interpreter._patch_lang, []

    class LaunchScope:
        def __init__(self):
            self.scopes = {}  # the patched modules -> their patch scope

        def restore(self):
            launches.pop()
            for scope in reversed(list(self.scopes.values())):
                scope.restore()

    def patch_once(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        launch = launches[-1] if launches else LaunchScope()
        if langs not in launch.scopes:
            launch.scopes[langs] = patch(fn)
        if not launches:
            launches.append(launch)
        return launch

    interpreter._patch_lang = patch_once


def _numpy_dtypes_once():
    """The interpreter builds its Triton -> numpy dtype table at each of its
    calls (every splat, cast and masked load: ~7% of an interpreted step);
    the same answers, each looked up once by the type's name."""
    from triton.runtime import interpreter

    build, known = interpreter._get_np_dtype, {}

    def lookup(tt_dtype):
        name = str(tt_dtype)
        if name not in known:
            known[name] = build(tt_dtype)
        return known[name]

    interpreter._get_np_dtype = lookup


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _patch_language_once_per_launch()
        _numpy_dtypes_once()
    except ImportError:  # no Triton: its tests skip
        pass


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
    """A small CPU engine (:func:`engine_args`) of the caller's own, after the
    session's kept engine is shut down; shut it down with :func:`shutdown`."""
    from vllm import LLM

    SESSION_ENGINE.close()
    args = engine_args(model, oscar, **kwargs)
    # vLLM's ngram proposer imports numba, whose function wrappers break the
    # kernel-override scan of sys.modules at every later in-process start
    ngram = (args.get("speculative_config") or {}).get("method") == "ngram"
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if ngram:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        return LLM(**args)
    finally:
        torch.set_num_threads = SET_NUM_THREADS
        if ngram:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def engine_config(model: str = "house-qwen3", oscar: dict | None = None, **kwargs):
    """The VllmConfig such an engine would get, with every start-up check run,
    without starting the engine."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_kvq

    SESSION_ENGINE.close()  # parsing a config replaces the settings an in-process engine reads
    vllm_kvq.register()
    return EngineArgs(**engine_args(model, oscar, **kwargs)).create_engine_config()


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


class KeptEngine:
    """The engine of the last configuration asked for, kept until another
    configuration (or :func:`make_llm`) needs the process: tests in a row
    that use one configuration share one engine."""

    def __init__(self):
        self.key, self.llm = None, None

    def __call__(self, model: str = "house-qwen3", oscar: dict | None = None, **kwargs):
        key = json.dumps(engine_args(model, oscar, **kwargs), sort_keys=True, default=str)
        if key != self.key:
            llm = make_llm(model, oscar, **kwargs)  # shuts the kept one down first
            self.key, self.llm = key, llm
        return self.llm

    def close(self) -> None:
        llm, self.key, self.llm = self.llm, None, None
        if llm is not None:
            shutdown(llm)


SESSION_ENGINE = KeptEngine()


# The README's ``pytest -q tests`` runs on two pytest-xdist workers
# (pyproject.toml: ``-n 2 --dist loadfile``), one a core. Each module runs
# whole on one worker, so its module fixtures and kept engines start once; a
# worker that runs out takes the next module in collection order, where the
# modules that take minutes come first, longest first, so the short ones fill
# in around them.
LONGEST_FIRST = (
    "tests/backends/test_spec_decode.py",
    "tests/backends/test_prefix_caching.py",
    "tests/backends/test_tensor_parallel.py",
    "tests/backends/test_triton_path.py",
    "tests/backends/test_oscar_engine.py",
    "tests/kernels/test_oscar_triton.py",
    "tests/backends/test_server.py",
    "tests/backends/test_hybrid.py",
    "tests/backends/test_state_pool.py",
)


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: modules stay in order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` that hands a worker its next module when one test
    is left, not two: an xdist worker holds back its last test until more
    work or the end comes, and a module handed out a test early can leave the
    other worker idle at the end."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # keep the collection's order, not the most tests first

    class ModuleWhenIdle(LoadFileScheduling):
        def _reschedule(self, node):
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return ModuleWhenIdle(config, log)


@pytest.fixture(scope="session")
def engines():
    """``engines(model, oscar, **kwargs)``: an engine of that configuration
    (:func:`engine_args`), the kept one if the last request asked for the
    same (:class:`KeptEngine`)."""
    yield SESSION_ENGINE
    SESSION_ENGINE.close()


@pytest.fixture(scope="session")
def greedy():
    from vllm import SamplingParams

    def params(max_tokens: int = 16, **kw):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)

    return params
