"""The OSCAR backend inside real vLLM (CPU build) on house-qwen3: exactness
while sink and window hold every token, the capacity vLLM reports at one
memory budget, and the INT2 path (the calibrated artifact with a small sink
and window, fp32): chunked prefill, preemption, and an independent PyTorch
model of the same math. Configurations that several tests use come from the
session's engines (conftest ``engines``); the others start and stop in their
test."""

import copy
import math

import pytest

from evalkit.compare import compare
from tests.conftest import REPO, make_llm, needles, shutdown

pytestmark = pytest.mark.slow

LONG = 32768  # max_model_len of the capacity engines
BUDGET = 1 << 30  # same KV-cache bytes for BF16 and OSCAR
ARTIFACT = REPO / "examples" / "artifacts" / "house-qwen3-oscar"  # per KV head, clip 0.96 / 0.92
# a short sink and window: most of each sequence is read as INT2
INT2 = {"artifact": str(ARTIFACT), "sink": 16, "window": 32, "override_artifact": True}
BF16 = dict(max_model_len=LONG, kv_cache_memory_bytes=BUDGET)
HADAMARD_BF16 = dict(BF16, oscar={"rotation": "hadamard"})
FP32 = dict(dtype="float32", max_model_len=2048)
CALIBRATED_FP32 = dict(FP32, oscar={"artifact": str(ARTIFACT)})
INT2_SMALL_CHUNKS = dict(oscar=INT2, dtype="float32", max_num_batched_tokens=64)
INT2_BIG_CHUNKS = dict(oscar=INT2, dtype="float32", max_num_batched_tokens=4096)


def _short_prompts():
    text = (needles(max_tokens=4096)[0]["prompt"]).splitlines()
    return ["\n".join(text[i : i + 12]) + "\n" for i in range(0, 72, 12)]


def generate(config: dict, prompts, params):
    """Outputs of an engine started for this call alone."""
    llm = make_llm(**config)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        shutdown(llm)


def test_exact_in_fp32_when_sink_and_window_cover_the_sequence(greedy):
    """Prompts + generation < S0 + W: nothing is INT2. The calibrated
    per-KV-head artifact in fp32 against CPU_ATTN: the only difference left
    is OSCAR's BF16 storage of the rows, so greedy tokens must be equal."""
    prompts = _short_prompts()
    ref = generate(FP32, prompts, greedy(24, logprobs=1))
    got = generate(CALIBRATED_FP32, prompts, greedy(24, logprobs=1))
    assert all(len(r.prompt_token_ids) + 24 <= 64 + 256 for r in ref)
    out = compare(got, ref)
    assert out["whole_sequences_equal"] == len(prompts)
    assert out["dlogprob_mean"] < 0.02 and out["dlogprob_max"] < 0.1


def test_exact_in_bf16_when_sink_and_window_cover_the_sequence(engines, greedy):
    """The same in the model's bf16 (Hadamard per layer), where the folded
    weights round differently and greedy choices sit at bf16 near ties from
    the first steps on CPUs with bf16 units: both engines score the
    reference's own continuation (teacher forcing) and the log-probabilities
    must agree."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ref = engines(**BF16).generate(_short_prompts(), greedy(24), use_tqdm=False)
    full = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids) + list(r.outputs[0].token_ids)) for r in ref]
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    a = engines(**BF16).generate(full, score, use_tqdm=False)
    b = engines(**HADAMARD_BF16).generate(full, score, use_tqdm=False)
    diffs = []
    for r, x, y in zip(ref, a, b):
        assert len(x.prompt_token_ids) + 1 <= 64 + 256
        ids = x.prompt_token_ids
        diffs += [abs(x.prompt_logprobs[i][ids[i]].logprob - y.prompt_logprobs[i][ids[i]].logprob)
                  for i in range(len(r.prompt_token_ids), len(ids))]
    assert sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.1


def test_capacity_at_the_same_memory_budget(engines):
    """vLLM's block count and reported KV capacity (tokens at max_model_len)
    for BF16 and OSCAR at one budget are the page formats' (OSCAR: each
    request holds its INT2 data blocks plus the BF16 sink/window blocks)."""
    from transformers import AutoConfig

    from tests.conftest import model_path
    from vllm_kvq.backends.resolve import page_format
    from vllm_kvq.backends.settings import OscarSettings

    hf = AutoConfig.from_pretrained(model_path())
    d, heads, layers = hf.head_dim, hf.num_key_value_heads, hf.num_hidden_layers
    # copies: an engine's shutdown (the next start's first step) clears its figures
    bf16 = copy.copy(engines(**BF16).llm_engine.vllm_config.cache_config)
    oscar = copy.copy(engines(**HADAMARD_BF16).llm_engine.vllm_config.cache_config)
    fmt = page_format(d, oscar.block_size, OscarSettings.from_dict(HADAMARD_BF16["oscar"]))
    assert (fmt.bytes_per_token, fmt.state_blocks) == (72, 18)
    assert bf16.num_gpu_blocks == BUDGET // (layers * heads * bf16.block_size * 2 * d * 2)
    assert oscar.num_gpu_blocks == BUDGET // (layers * heads * fmt.block_bytes)
    assert bf16.kv_cache_size_tokens == bf16.num_gpu_blocks * bf16.block_size
    per_request = math.ceil(LONG / oscar.block_size) + fmt.state_blocks
    assert oscar.kv_cache_size_tokens == int(oscar.num_gpu_blocks / per_request * LONG)
    assert oscar.kv_cache_size_tokens / bf16.kv_cache_size_tokens >= 6.5


def _needle_prompts(n=6):
    return [r["prompt"] for r in needles(max_tokens=1200, limit=n)]


def test_chunked_prefill_gives_the_same_tokens(engines, greedy):
    prompts = _needle_prompts()
    small = engines(**INT2_SMALL_CHUNKS).generate(prompts, greedy(24), use_tqdm=False)
    big = engines(**INT2_BIG_CHUNKS).generate(prompts, greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in big]


def test_int2_path_is_really_quantizing(engines, greedy):
    """Same prompts with everything in BF16 must score differently."""
    prompts = _needle_prompts(3)
    params = greedy(1, prompt_logprobs=0)
    int2 = engines(**INT2_BIG_CHUNKS).generate(prompts, params, use_tqdm=False)
    full = generate(dict(INT2_BIG_CHUNKS, oscar={**INT2, "window": 4096}), prompts, params)
    diffs = []
    for a, b in zip(int2, full):
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (ta, la), = [(t, v.logprob) for t, v in pa.items() if v.rank is not None][:1]
            diffs.append(abs(la - pb[ta].logprob))
    assert sum(diffs) / len(diffs) > 1e-3


def test_preemption_gives_the_same_tokens(engines, greedy):
    prompts = _needle_prompts(4)
    ref = engines(**INT2_BIG_CHUNKS).generate(prompts, greedy(64), use_tqdm=False)
    # Requests of 994, 515, 972 and 485 tokens hold 8, 5, 8 and 4 INT2 blocks
    # of 128 tokens plus 3 state blocks each: 31 blocks (one is vLLM's null
    # block) admit the first three and leave none free, so the first to reach
    # a new block (the 994-token one, 31 tokens in) preempts another, which
    # later resumes.
    tight = make_llm(**INT2_BIG_CHUNKS, num_gpu_blocks_override=31, max_model_len=2048, disable_log_stats=False)
    try:
        got = tight.generate(prompts, greedy(64), use_tqdm=False)
        preempted = sum(m.value for m in tight.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        shutdown(tight)
    assert preempted > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_int2_path_matches_standalone_pytorch(engines, greedy):
    """vLLM (paged INT2 + BF16 sink/window, 64-token chunks) against an
    independent PyTorch model of the same math, on dev needle prompts."""
    from tests.backends.oscar_standalone import OscarStandalone, assert_matches_standalone
    from tests.conftest import model_path
    from vllm_kvq.artifacts import OscarArtifact

    ref = OscarStandalone(model_path(), OscarArtifact.load(ARTIFACT), INT2["sink"], INT2["window"])
    assert_matches_standalone(engines(**INT2_SMALL_CHUNKS), _needle_prompts(2), ref,
                              greedy(8, prompt_logprobs=0, logprobs=0), "OSCAR")
