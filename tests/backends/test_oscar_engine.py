"""The OSCAR backend inside real vLLM (CPU build) on house-qwen3.

Engines are shared per module: two BF16-dtype engines (CPU_ATTN and OSCAR)
for exactness and capacity, and fp32-dtype OSCAR engines with a small sink and
window for the INT2 path, chunked prefill and preemption.
"""

import math

import pytest

from tests.conftest import REPO, make_llm, needles, shutdown

pytestmark = pytest.mark.slow

LONG = 32768  # max_model_len of the capacity engines
BUDGET = 1 << 30  # same KV-cache bytes for BF16 and OSCAR
INT2 = {"rotation": "hadamard", "sink": 16, "window": 32, "k_clip": 0.96, "v_clip": 0.92}


@pytest.fixture(scope="module")
def bf16_llm():
    llm = make_llm(max_model_len=LONG, kv_cache_memory_bytes=BUDGET)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def oscar_llm():
    llm = make_llm(oscar={"rotation": "hadamard"}, max_model_len=LONG, kv_cache_memory_bytes=BUDGET)
    yield llm
    shutdown(llm)


def _short_prompts():
    text = (needles(max_tokens=4096)[0]["prompt"]).splitlines()
    return ["\n".join(text[i : i + 12]) + "\n" for i in range(0, 72, 12)]


@pytest.fixture(scope="module")
def fp32_llm():
    llm = make_llm(dtype="float32", max_model_len=2048)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def calibrated_llm():
    art = REPO / "examples" / "artifacts" / "house-qwen3-oscar"
    llm = make_llm(oscar={"artifact": str(art)}, dtype="float32", max_model_len=2048)
    yield llm
    shutdown(llm)


@pytest.mark.parametrize("reference,engine", [("bf16_llm", "oscar_llm"), ("fp32_llm", "calibrated_llm")])
def test_exact_when_sink_and_window_cover_the_sequence(reference, engine, greedy, request):
    """Prompts + generation < S0 + W: nothing is INT2. Against CPU_ATTN: the
    calibrated per-KV-head artifact in fp32 (the only difference left is
    OSCAR's BF16 storage of the rows) must give the same greedy tokens. In the
    model's bf16 (Hadamard per layer) the folded weights round differently and
    greedy choices sit at bf16 near ties from the first steps on CPUs with bf16
    units, so there both engines score the reference's own continuation
    (teacher forcing) and the log-probabilities must agree."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = _short_prompts()
    ref_llm, llm = request.getfixturevalue(reference), request.getfixturevalue(engine)
    ref = ref_llm.generate(prompts, greedy(24, logprobs=1), use_tqdm=False)
    diffs = []
    if reference == "fp32_llm":
        got = llm.generate(prompts, greedy(24, logprobs=1), use_tqdm=False)
        for r, g in zip(ref, got):
            assert len(r.prompt_token_ids) + 24 <= 64 + 256
            assert g.outputs[0].token_ids == r.outputs[0].token_ids
            for lr, lg, tok in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, r.outputs[0].token_ids):
                diffs.append(abs(lr[tok].logprob - lg[tok].logprob))
    else:
        full = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids) + list(r.outputs[0].token_ids)) for r in ref]
        score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        a, b = ref_llm.generate(full, score, use_tqdm=False), llm.generate(full, score, use_tqdm=False)
        for r, x, y in zip(ref, a, b):
            assert len(x.prompt_token_ids) + 1 <= 64 + 256
            n = len(r.prompt_token_ids)
            ids = x.prompt_token_ids
            diffs += [abs(x.prompt_logprobs[i][ids[i]].logprob - y.prompt_logprobs[i][ids[i]].logprob)
                      for i in range(n, len(ids))]
    print(f"\nlogprob |diff| mean {sum(diffs)/len(diffs):.4f} max {max(diffs):.4f} over {len(diffs)} tokens")
    assert sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.1


def _reported(llm) -> int:
    return llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens


def test_capacity_at_the_same_memory_budget(bf16_llm, oscar_llm):
    """vLLM's reported KV capacity (tokens that fit at max_model_len)."""
    bf16, oscar = _reported(bf16_llm), _reported(oscar_llm)
    ratio = oscar / bf16
    print(f"\nKV capacity at {BUDGET >> 20} MiB, max_model_len {LONG}: "
          f"BF16 {bf16:,} tokens, OSCAR {oscar:,} tokens, ratio {ratio:.2f}x")
    cfg = oscar_llm.llm_engine.vllm_config.cache_config
    blocks, kb = cfg.num_gpu_blocks, cfg.block_size
    # Each request holds ceil(L / KB) INT2 blocks plus 18 BF16 state blocks.
    assert oscar == int(blocks / (math.ceil(LONG / kb) + 18) * LONG)
    for length in (4096, 16384, LONG, 131072):
        per_req = math.ceil(length / kb) + 18
        print(f"  at {length:>6} tokens/request: {7.111 * math.ceil(length / kb) * kb / (per_req * kb):.2f}x "
              "(INT2 7.11x, less the per-request sink/window)")
    assert ratio >= 6.5


@pytest.fixture(scope="module")
def int2_small_chunks():
    llm = make_llm(oscar=INT2, dtype="float32", max_num_batched_tokens=64)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def int2_big_chunks():
    llm = make_llm(oscar=INT2, dtype="float32", max_num_batched_tokens=4096)
    yield llm
    shutdown(llm)


def _needle_prompts(n=6):
    return [r["prompt"] for r in needles(max_tokens=1200, limit=n)]


def test_chunked_prefill_gives_the_same_tokens(int2_small_chunks, int2_big_chunks, greedy):
    prompts = _needle_prompts()
    small = int2_small_chunks.generate(prompts, greedy(24), use_tqdm=False)
    big = int2_big_chunks.generate(prompts, greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in big]


def test_int2_path_is_really_quantizing(int2_big_chunks, greedy):
    """Same prompts with everything in BF16 must score differently."""
    prompts = _needle_prompts(3)
    params = greedy(1, prompt_logprobs=0)
    int2 = int2_big_chunks.generate(prompts, params, use_tqdm=False)
    exact = make_llm(oscar={**INT2, "window": 4096}, dtype="float32", max_num_batched_tokens=4096)
    try:
        full = exact.generate(prompts, params, use_tqdm=False)
    finally:
        shutdown(exact)
    diffs = []
    for a, b in zip(int2, full):
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (ta, la), = [(t, v.logprob) for t, v in pa.items() if v.rank is not None][:1]
            diffs.append(abs(la - pb[ta].logprob))
    assert sum(diffs) / len(diffs) > 1e-3


def test_preemption_gives_the_same_tokens(int2_big_chunks, greedy):
    prompts = _needle_prompts(8)
    ref = int2_big_chunks.generate(prompts, greedy(160), use_tqdm=False)
    # A ~1K-token request holds ~9 INT2 blocks of 128 tokens plus 3 state
    # blocks and grows by 2 blocks while it generates: 30 blocks admit two or
    # three requests, whose growth then forces preemptions.
    tight = make_llm(oscar=INT2, dtype="float32", max_num_batched_tokens=4096,
                     num_gpu_blocks_override=30, max_model_len=2048,
                     disable_log_stats=False)
    try:
        got = tight.generate(prompts, greedy(160), use_tqdm=False)
        metrics = tight.get_metrics()
        preempted = sum(m.value for m in metrics if m.name == "vllm:num_preemptions")
        print("\npreemptions:", preempted, sorted({m.name for m in metrics if "preempt" in m.name}))
    finally:
        shutdown(tight)
    assert preempted > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_int2_path_matches_standalone_pytorch(int2_small_chunks, greedy):
    """vLLM (paged INT2 + BF16 sink/window, 64-token chunks) against an
    independent PyTorch model of the same math, on dev needle prompts."""
    from vllm_kvq.artifacts import builtin_artifact, model_fingerprint
    from transformers import AutoConfig

    from tests.backends.oscar_standalone import OscarStandalone, assert_matches_standalone
    from tests.conftest import model_path

    cfg = AutoConfig.from_pretrained(model_path())
    art = builtin_artifact(model_fingerprint(cfg), "hadamard", k_clip=INT2["k_clip"], v_clip=INT2["v_clip"])
    ref = OscarStandalone(model_path(), art, INT2["sink"], INT2["window"])
    prompts = _needle_prompts(4)
    assert_matches_standalone(int2_small_chunks, prompts, ref, greedy(8, prompt_logprobs=0, logprobs=0), "OSCAR")
