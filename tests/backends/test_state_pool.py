"""The quantized GDN state pool (``kvq.state``) in real vLLM on CPU, on
house-qwen3next (6 GDN layers of 4 value heads of 128 x 128).

The reference is vLLM's own FP32 state. Staging must be transparent: an FP16
pool (every head a pivot) must give FP32's tokens; quantized pools must stay
close, and the pages vLLM allocates must really shrink. (TP=2:
test_tensor_parallel.)
"""

import pytest

from evalkit.compare import compare as compare_runs
from evalkit.probe import allocated_state_bytes
from tests.conftest import REPO, make_llm, needles, shutdown
from vllm_kvq.artifacts.stepquant import StepQuantPlan

pytestmark = pytest.mark.slow
PLAN = REPO / "examples" / "artifacts" / "house-qwen3next-stepquant"
OSCAR = REPO / "examples" / "artifacts" / "house-qwen3next-oscar"
MODEL = "house-qwen3next"
GDN_LAYERS = 6
FP32_STATES = dict(model=MODEL, dtype="bfloat16", max_model_len=2048, mamba_ssm_cache_dtype="float32")
# STEPQuant @6 on the GDN layers and OSCAR INT2 on the attention layers of the
# same model (sink 16, window 32, so INT2 is read); without the state keys,
# OSCAR alone over vLLM's FP32 states
STEPQUANT_WITH_OSCAR = dict(FP32_STATES, oscar={
    "state": "stepquant", "state_artifact": str(PLAN), "state_bits": 6, "artifact": str(OSCAR), "sink": 16,
    "window": 32, "override_artifact": True})
OSCAR_ONLY = dict(FP32_STATES, oscar={k: v for k, v in STEPQUANT_WITH_OSCAR["oscar"].items()
                                      if not k.startswith("state")})


def compare(got, ref, label: str = "") -> tuple[int, float, float]:
    """Asserts that ``got`` gives the reference's greedy tokens up to its first
    near tie (:func:`evalkit.compare.compare`); (tokens compared, |dlogprob|
    mean and max)."""
    out = compare_runs(got, ref)
    assert out["equal_up_to_tie"] == out["prompts"], f"{label}: runs part at steps {out['first_divergence']}"
    return out["tokens_compared"], out["dlogprob_mean"], out["dlogprob_max"]


def pool(config: dict, **kvq) -> dict:
    """FP32_STATES with ``kvq`` as the state settings."""
    return dict(config, additional_config={"kvq": kvq})


def probe(llm, config: dict, greedy, prompts):
    """(state-pool bytes per request, outputs, per-rank layers) of the engine
    of ``config``, its states checked to be packed records or vLLM's FP32 ones."""
    ranks = llm.apply_model(allocated_state_bytes)
    packed = "state" in config.get("oscar", config.get("additional_config", {}).get("kvq", {}))
    for layers in ranks:
        assert len(layers) == GDN_LAYERS
        for layer in layers:
            if packed:
                assert layer["dtype"] == "torch.uint8" and len(layer["shape"]) == 1
            else:
                assert layer["dtype"] == "torch.float32" and layer["shape"][1:] == [128, 128]
    return sum(layer["page_bytes"] for layer in ranks[0]), llm.generate(prompts, greedy(24, logprobs=2),
                                                                        use_tqdm=False), ranks


def run(config: dict, greedy, prompts):
    """:func:`probe` of an engine started for this call alone."""
    llm = make_llm(**config)
    try:
        return probe(llm, config, greedy, prompts)
    finally:
        shutdown(llm)


def test_decode_plan_takes_the_triton_step_where_it_can():
    """A pool's decode plan (cached per pool and device, with its scratch): the
    Triton step for the row-wise and STEPQuant fits at power-of-two K, none
    where the pool stages through the reference codec or K is not a power of two."""
    import torch

    from vllm_kvq.backends.state_pool import LayerPool, decode_plan
    from vllm_kvq.kernels.stepquant.format import StateLayout

    lay, cpu = StateLayout((6, 16), 32, 32), torch.device("cpu")
    pool = LayerPool(lay, torch.ones(2, 32), "rowwise", torch.float32)
    decoder = decode_plan(pool, cpu, 1, rows=8)
    assert decoder.plan.rowwise and decode_plan(pool, cpu, 1) is decoder
    assert decoder.scratch.capacity == 8 and decoder.scratch.keys.shape == (8, 1, 32)
    assert decode_plan(LayerPool(lay, torch.ones(2, 32), "stepquant", torch.float32, "reference"), cpu, 1) is None
    odd = LayerPool(StateLayout((6,), 48, 32), torch.ones(1, 48), "stepquant", torch.float32)
    assert decode_plan(odd, cpu, 1) is None  # K = 48: the kernel needs powers of two; stays staged


def test_refit_every_holds_updates_in_the_record():
    """``state_refit_every: 4``: every layer's records hold 3 updates (their
    bytes after the heads, format.py), in the one record size vLLM allocates."""
    from transformers import AutoConfig

    from tests.conftest import model_path
    from vllm_kvq.backends.resolve import pool_plan
    from vllm_kvq.backends.settings import OscarSettings

    cfg = AutoConfig.from_pretrained(model_path(MODEL))
    plain, held = (pool_plan(OscarSettings.from_dict({"state": "uniform", "state_bits": 6, **extra}), cfg, 1)
                   for extra in ({}, {"state_refit_every": 4}))
    for layer in plain.bits:
        lay, lay_held = plain.local(layer, 1, 0)[0], held.local(layer, 1, 0)[0]
        assert (lay.tail, lay_held.tail) == (0, 3)
        # 4 heads of 128 x 128: a count, then per head d and w (16 B) and 3 x (u, k) in fp16
        assert lay_held.packed_bytes == -(-lay.packed_bytes // 16) * 16 + 16 + 4 * (16 + 3 * 2 * 256)
        assert held.record_bytes == -(-lay_held.packed_bytes // 16) * 16 == lay_held.size
    assert "refit every 4" in held.source


@pytest.fixture(scope="module")
def prompts():
    return [r["prompt"] for r in needles(max_tokens=1500, limit=6)]


@pytest.fixture(scope="module")
def fp32(greedy, prompts):
    return run(FP32_STATES, greedy, prompts)[:2]


def test_fp16_pool_is_transparent(greedy, prompts, fp32):
    page_ref, ref = fp32
    page, got, _ = run(pool(FP32_STATES, state="uniform", state_bits=16), greedy, prompts)
    compared, mean, worst = compare(got, ref, "FP16 pool vs FP32")
    assert compared >= 36  # a quarter of the 144 generated tokens at least
    assert mean < 0.02 and worst < 0.1
    assert page < 0.6 * page_ref


def test_uniform_int6_pool_is_close_and_small(greedy, prompts, fp32):
    page_ref, ref = fp32
    page, got, _ = run(pool(FP32_STATES, state="uniform", state_bits=6), greedy, prompts)
    assert compare(got, ref, "uniform INT6 vs FP32")[0] >= 24
    # vLLM pads each state page to whole attention blocks; the pool picks small
    # blocks so the padding stays small: pages as allocated, conv state included
    assert page_ref / page >= 4.5


def test_stepquant_with_oscar_attention(engines, greedy, prompts, fp32):
    """Against OSCAR with vLLM's FP32 states: the same INT2 attention, so the
    difference is the packed state alone."""
    page_ref, _ = fp32
    page, got, ranks = probe(engines(**STEPQUANT_WITH_OSCAR), STEPQUANT_WITH_OSCAR, greedy, prompts)
    _, ref, _ = run(OSCAR_ONLY, greedy, prompts)
    compared, mean, _ = compare(got, ref, "STEPQuant @6 + OSCAR vs OSCAR + FP32 state")
    assert compared >= 24 and mean < 0.05
    assert page_ref / page >= 4.5
    plan = StepQuantPlan.load(PLAN)
    assert [tuple(layer["bits"]) for layer in ranks[0]] == [plan.head_bits(6, i) for i in plan.layers]
