"""The quantized GDN state pool (``kvq.state``) in real vLLM on CPU, on
house-qwen3next (6 GDN layers of 4 value heads of 128 x 128).

The reference is vLLM's own FP32 state. Staging must be transparent: an FP16
pool (every head a pivot) must give FP32's tokens; quantized pools must stay
close, and the pages vLLM allocates must really shrink.
"""

import os

import pytest

from tests.conftest import REPO, make_llm, needles, shutdown
from vllm_kvq.artifacts.stepquant import StepQuantPlan
from evalkit.probe import allocated_state_bytes

pytestmark = pytest.mark.slow
PLAN = REPO / "examples" / "artifacts" / "house-qwen3next-stepquant"
OSCAR = REPO / "examples" / "artifacts" / "house-qwen3next-oscar"
MODEL = "house-qwen3next"
TIE = 0.25  # top-2 logprob margin under which a bf16 model's greedy choice is a coin toss
GDN_LAYERS = 6


def run(greedy, prompts, kvq=None, return_ranks=False, **kw):
    """(per-request state-pool bytes, outputs) of one engine; FP32 states unless ``kvq`` says otherwise."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function
    extra = {"additional_config": {"kvq": kvq}} if kvq else {}
    llm = make_llm(MODEL, dtype="bfloat16", max_model_len=2048, mamba_ssm_cache_dtype="float32", **extra, **kw)
    try:
        ranks = llm.apply_model(allocated_state_bytes)
        for layers in ranks:
            assert len(layers) == GDN_LAYERS
            for layer in layers:
                if kvq and kvq.get("state"):
                    assert layer["dtype"] == "torch.uint8" and len(layer["shape"]) == 1
                else:
                    assert layer["dtype"] == "torch.float32" and layer["shape"][1:] == [128, 128]
        pool = sum(layer["page_bytes"] for layer in ranks[0])
        outs = llm.generate(prompts, greedy(24, logprobs=2), use_tqdm=False)
        return (pool, outs, ranks) if return_ranks else (pool, outs)
    finally:
        shutdown(llm)


def compare(got, ref, label: str, pages: str = ""):
    """Tokens equal up to the reference's first near tie; |dlogprob| there
    (printed under ``label``, with ``pages`` after)."""
    compared, diffs = 0, []
    for a, b in zip(got, ref):
        steps = b.outputs[0].logprobs
        margins = [(lambda top: top[0] - top[1])(sorted((x.logprob for x in lp.values()), reverse=True))
                   for lp in steps]
        clear = next((i for i, m in enumerate(margins) if m < TIE), len(margins))
        assert a.outputs[0].token_ids[:clear] == b.outputs[0].token_ids[:clear]
        compared += clear
        diffs += [abs(a.outputs[0].logprobs[i][t].logprob - steps[i][t].logprob)
                  for i, t in enumerate(b.outputs[0].token_ids[:clear])]
    mean, worst = sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0)
    print(f"\n{label}: {compared} tokens equal up to ties, |dlogprob| mean {mean:.4f} max {worst:.4f}{pages}")
    return compared, mean, worst


@pytest.fixture(scope="module")
def prompts():
    return [r["prompt"] for r in needles(max_tokens=1500, limit=6)]


@pytest.fixture(scope="module")
def fp32(greedy, prompts):
    return run(greedy, prompts)


def test_fp16_pool_is_transparent(greedy, prompts, fp32):
    page_ref, ref = fp32
    page, got = run(greedy, prompts, {"state": "uniform", "state_bits": 16})
    compared, mean, worst = compare(got, ref, "FP16 pool vs FP32",
                                    f"; state pool {page:,} B vs {page_ref:,} B per request")
    assert compared >= 36  # a quarter of the 144 generated tokens at least
    assert mean < 0.02 and worst < 0.1
    assert page < 0.6 * page_ref


def test_uniform_int6_pool_is_close_and_small(greedy, prompts, fp32):
    page_ref, ref = fp32
    page, got = run(greedy, prompts, {"state": "uniform", "state_bits": 6})
    compared, _, _ = compare(got, ref, "uniform INT6 vs FP32",
                             f"; state pool {page:,} B vs {page_ref:,} B per request ({page_ref / page:.2f}x)")
    assert compared >= 24
    # vLLM pads each state page to whole attention blocks; the pool picks small
    # blocks so the padding stays small: pages as allocated, conv state included
    assert page_ref / page >= 4.5


@pytest.fixture(scope="module")
def stepquant_with_oscar(greedy, prompts):
    """STEPQuant @6 on the GDN layers and OSCAR INT2 on the attention layers
    of the same model (sink 16, window 32, so INT2 is read)."""
    kvq = {"state": "stepquant", "state_artifact": str(PLAN), "state_bits": 6,
           "artifact": str(OSCAR), "sink": 16, "window": 32, "override_artifact": True}
    return kvq, run(greedy, prompts, kvq, return_ranks=True, attention_backend="OSCAR")


def test_stepquant_with_oscar_attention(greedy, prompts, fp32, stepquant_with_oscar):
    """Against OSCAR with vLLM's FP32 states: the same INT2 attention, so the
    difference is the packed state alone."""
    page_ref, _ = fp32
    kvq, (page, got, ranks) = stepquant_with_oscar
    oscar_only = {k: v for k, v in kvq.items() if not k.startswith("state")}
    _, ref = run(greedy, prompts, oscar_only, attention_backend="OSCAR")
    compared, mean, _ = compare(got, ref, "STEPQuant @6 + OSCAR vs OSCAR + FP32 state",
                                f"; state pool {page:,} B vs {page_ref:,} B ({page_ref / page:.2f}x)")
    assert compared >= 24 and mean < 0.05
    assert page_ref / page >= 4.5
    plan = StepQuantPlan.load(PLAN)
    assert [tuple(layer["bits"]) for layer in ranks[0]] == [plan.head_bits(6, i) for i in plan.layers]


def test_tensor_parallel_ranks_hold_their_own_heads(greedy, prompts, stepquant_with_oscar, monkeypatch):
    """TP=2: each rank packs its own two value heads (widths sliced from the
    plan; records padded to the larger rank), and tokens equal TP=1's up to
    its first near tie."""
    kvq, (_, one, _) = stepquant_with_oscar
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    _, two, ranks = run(greedy, prompts, kvq, return_ranks=True, attention_backend="OSCAR",
                        tensor_parallel_size=2, distributed_executor_backend="mp")
    plan = StepQuantPlan.load(PLAN)
    for rank, layers in enumerate(ranks):
        for layer in layers:
            assert tuple(layer["bits"]) == plan.head_bits(6, layer["layer"])[2 * rank: 2 * rank + 2]
    sizes = {layer["shape"][0] for layers in ranks for layer in layers}
    assert len(sizes) == 1  # one record size for every layer and rank
    compared, _, _ = compare(two, one, "TP=2 vs TP=1 (STEPQuant @6 + OSCAR)")
    assert compared >= 24


def test_state_pool_needs_a_gdn_model():
    with pytest.raises(Exception, match="no GDN layers"):
        make_llm("house-qwen3", additional_config={"kvq": {"state": "uniform"}})


@pytest.mark.parametrize("kvq, message", [
    ({"state": "stepquant"}, "needs kvq.state_artifact"),
    ({"state": "uniform", "state_bits": 5}, "state_bits must be one of"),
    ({"state": "int6"}, "kvq.state must be one of"),
    ({"state_artifact": "/nowhere"}, "kvq.state is not"),
])
def test_bad_state_settings_fail_at_start(kvq, message):
    with pytest.raises(Exception, match=message):
        make_llm(MODEL, dtype="bfloat16", additional_config={"kvq": kvq})


@pytest.mark.parametrize("mode, kvq, message", [
    ("NONE", {}, None),
    ("FULL_DECODE_ONLY", {}, None),
    ("FULL_AND_PIECEWISE", {}, "cudagraph_mode FULL_AND_PIECEWISE.*FULL_DECODE_ONLY.*--enforce-eager"),
    ("PIECEWISE", {}, "cudagraph_mode PIECEWISE.*FULL_DECODE_ONLY"),
    ("FULL", {}, "cudagraph_mode FULL\\).*FULL_DECODE_ONLY"),
    ("FULL_DECODE_ONLY", {"kernels": "reference"}, "'reference' stages them.*--enforce-eager"),
    ("FULL_DECODE_ONLY", {"k_dim": 96}, "power-of-two K.*--enforce-eager"),
])
def test_cuda_graph_modes_the_state_pool_takes(mode, kvq, message):
    """On CUDA, full graphs may capture decode-only batches (the Triton step)
    and nothing that stages states: the decision at start, for every mode."""
    import dataclasses
    import types

    from transformers import AutoConfig
    from vllm.config import CompilationConfig, CUDAGraphMode

    from tests.conftest import model_path
    from vllm_kvq.backends import settings as kvq_settings
    from vllm_kvq.backends.resolve import pool_plan
    from vllm_kvq.backends.startup import _check_state_graphs

    k_dim = kvq.pop("k_dim", None)
    s = kvq_settings.OscarSettings.from_dict({"state": "uniform", **kvq})
    plan = pool_plan(s, AutoConfig.from_pretrained(model_path(MODEL)), 1)
    if k_dim:
        plan = dataclasses.replace(plan, k_dim=k_dim)
    config = types.SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode[mode]))
    if message is None:
        _check_state_graphs(config, s, plan)
    else:
        with pytest.raises(ValueError, match=message):
            _check_state_graphs(config, s, plan)
