"""Automatic prefix caching with the OSCAR cache, in real vLLM on CPU.

House-qwen3 with its calibrated artifact, fp32, decode regime (chunks of at
most 64 tokens, so every prompt token reads the cache as a decoded token
would). The reference is the same engine with prefix caching off: a hit must
give the same greedy tokens (compared up to the reference's first near tie,
and in fp32 every token), and vLLM's own counters must show the hits.

Two setting pairs: the defaults (sink 64, window 256, 128-token blocks,
64-token chunks) and a small one (sink 48, window 32, 32-token blocks and
chunks: a hit can end inside the sink, and INT2 pages are read after 80
tokens). A window checkpoint is taken where a step starts on a block
boundary, so a prompt scheduled alone leaves one at every block it crosses.
"""

import pytest

from tests.backends.test_state_pool import compare
from tests.conftest import REPO, needles

pytestmark = pytest.mark.slow

ARTIFACT = str(REPO / "examples" / "artifacts" / "house-qwen3-oscar")
DEFAULTS = {"artifact": ARTIFACT}
SMALL = {"artifact": ARTIFACT, "sink": 48, "window": 32, "override_artifact": True}
SMALL_BLOCK = 32
DECODE_REGIME = dict(dtype="float32", max_num_batched_tokens=64, disable_log_stats=False)


DEFAULTS_ENGINE = dict(oscar=DEFAULTS, max_model_len=1280, **DECODE_REGIME)
SMALL_ENGINE = dict(oscar=SMALL, **{**DECODE_REGIME, "max_model_len": 1536, "block_size": SMALL_BLOCK,
                                    "max_num_batched_tokens": SMALL_BLOCK})
# the small settings with prefix caching in a pool of 150 blocks of 32 tokens (a
# request of 400 tokens holds 13 data and 20 state blocks, and leaves a 20-block
# checkpoint)
TIGHT_ENGINE = dict(SMALL_ENGINE, enable_prefix_caching=True, num_gpu_blocks_override=150)


def off(engines, config):
    """The engine of ``config`` with prefix caching off: the reference."""
    return engines(**config, enable_prefix_caching=False)


def on(engines, config):
    return engines(**config, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def texts():
    """Token ids of held-out code files, longest first."""
    from transformers import AutoTokenizer

    from tests.conftest import model_path

    tok = AutoTokenizer.from_pretrained(model_path())
    rows = needles(max_tokens=4096, min_tokens=1200, limit=12)
    return [tok(r["prompt"])["input_ids"] for r in rows]


def _prompts(ids_lists):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(ids)) for ids in ids_lists]


def _hits(llm) -> tuple[int, int]:
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:prefix_cache_")}
    return metrics["vllm:prefix_cache_queries"], metrics["vllm:prefix_cache_hits"]


def _run_in_order(llm, batches, params):
    """Generate batch after batch (later batches can hit earlier ones)."""
    outs = []
    for batch in batches:
        outs += llm.generate(_prompts(batch), params, use_tqdm=False)
    return outs


def _shared_prefix_case(engines, config, texts, greedy, prefix_len, block):
    """Prompts = one shared prefix (ending inside a block) + their own
    continuations: the first alone (writes the blocks), the second alone (its
    data hit has no window checkpoint yet, so it recomputes and leaves one at
    the shared boundary), then the others together, then the first again."""
    assert prefix_len % block
    prefix = texts[0][:prefix_len]
    prompts = [prefix + texts[i][200 : 200 + 120 + 40 * i] for i in range(4)]
    assert len({p[prefix_len] for p in prompts}) == len(prompts)  # they part right after the prefix
    batches = [[prompts[0]], [prompts[1]], prompts[2:], [prompts[0]]]
    params = greedy(24, logprobs=2)
    ref = _run_in_order(off(engines, config), batches, params)
    cached = on(engines, config)
    before = _hits(cached)
    got = _run_in_order(cached, batches, params)
    queries, hits = (a - b for a, b in zip(_hits(cached), before))
    compare(got, ref, f"APC on vs off, shared prefix of {prefix_len} tokens")
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    cached = [o.num_cached_tokens for o in got]
    shared = prefix_len // block * block
    print(f"cached tokens per request {cached}; vLLM counters: {hits} of {queries} queried tokens hit")
    assert cached[:2] == [0, 0]
    assert cached[2] == cached[3] == shared  # the shared boundary's checkpoint
    assert cached[4] == (len(prompts[0]) - 1) // block * block  # a resent prompt hits its last full block
    assert hits == sum(cached) > 0
    assert queries == sum(len(p) for b in batches for p in b)


def test_shared_prefix_with_default_sink_and_window(engines, texts, greedy):
    """Sink 64, window 256, 128-token blocks: a 700-token shared prefix (more
    than sink + window + 2 blocks, ending mid-block)."""
    _shared_prefix_case(engines, DEFAULTS_ENGINE, texts, greedy, prefix_len=700, block=128)


def test_shared_prefix_with_small_window(engines, texts, greedy):
    _shared_prefix_case(engines, SMALL_ENGINE, texts, greedy, prefix_len=270, block=SMALL_BLOCK)


def test_hit_shorter_than_the_sink(engines, texts, greedy):
    """Prompts sharing 40 tokens: the hit (one 32-token block) ends inside
    the 48-token sink, so the restored rows are sink rows only."""
    prefix = texts[1][:40]
    prompts = [prefix + texts[i][300:500] for i in (2, 3, 4)]
    batches = [[p] for p in prompts]
    params = greedy(24, logprobs=2)
    got = _run_in_order(on(engines, SMALL_ENGINE), batches, params)
    ref = _run_in_order(off(engines, SMALL_ENGINE), batches, params)
    compare(got, ref, "APC on vs off, 40-token shared prefix")
    assert [o.num_cached_tokens for o in got] == [0, 0, SMALL_BLOCK]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_multi_turn_replay(engines, texts, greedy):
    """8 conversations x 5 turns: each turn resends the conversation so far
    (previous prompt + its answer) plus a new user message. From turn 2 on at
    least 80% of the prompt tokens must hit, and every turn's tokens must be
    the reference's. The reference plays the whole conversations first; the
    cached engine then gets the same turns in the same order."""
    params = greedy(33, logprobs=2)  # 32 decode steps: one starts on a block boundary
    conversations, turns, refs = [texts[i][:320] for i in range(8)], [], []
    reference = off(engines, SMALL_ENGINE)
    for turn in range(5):
        turns.append(conversations)
        refs.append(reference.generate(_prompts(conversations), params, use_tqdm=False))
        user = [texts[(i + turn + 1) % len(texts)][900 + 30 * turn : 924 + 30 * turn] for i in range(8)]
        conversations = [c + list(r.outputs[0].token_ids) + u for c, r, u in zip(conversations, refs[-1], user)]
    cached = on(engines, SMALL_ENGINE)
    for turn, (conversations, ref) in enumerate(zip(turns, refs)):
        got = cached.generate(_prompts(conversations), params, use_tqdm=False)
        compare(got, ref, f"turn {turn + 1}")
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        prompt_tokens = sum(len(c) for c in conversations)
        hit = sum(o.num_cached_tokens for o in got) / prompt_tokens
        print(f"turn {turn + 1}: {prompt_tokens} prompt tokens, {hit:.1%} hit the cache")
        if turn:
            assert hit >= 0.8


def _spy_on_hits(llm) -> list[tuple[int, int]]:
    """(preemptions so far, hit tokens) of every prefix-cache lookup of the
    real scheduler's KV-cache manager (the engine core runs in this process)."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    seen, lookup = [], manager.get_computed_blocks

    def recorded(request):
        blocks, hit, *rest = lookup(request)
        seen.append((request.num_preemptions, hit))
        return (blocks, hit, *rest)

    manager.get_computed_blocks = recorded
    return seen


def test_eviction_then_rehits(engines, texts, greedy):
    """Prompts A fill the cache, prompts B evict it, A again recomputes what
    was evicted (same tokens), and A once more hits what that re-cached."""
    a = [texts[i][:400] for i in (5, 6, 7)]
    b = [texts[i][:400] for i in (8, 9, 10)]
    params = greedy(16, logprobs=2)
    batches = (a, b, a, a)
    refs = [_run_in_order(off(engines, SMALL_ENGINE), [[p] for p in batch], params) for batch in batches]
    tight = engines(**TIGHT_ENGINE)
    seen = _spy_on_hits(tight)
    runs = []
    for batch, ref in zip(batches, refs):
        got = _run_in_order(tight, [[p] for p in batch], params)
        compare(got, ref, "APC in a 150-block pool vs APC off")
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        runs.append([o.num_cached_tokens for o in got])
    print(f"cached tokens per request: {runs}; lookups (preemptions, hit): {seen}")
    assert sum(runs[0]) == 0 and sum(runs[1]) == 0
    assert sum(runs[2]) < sum(runs[3])  # B evicted part of A; the A rerun cached it again
    assert sum(runs[3]) >= 0.5 * sum(len(p) for p in a)


def test_preemption_with_cached_blocks(engines, texts, greedy):
    """Eight requests on one cached 161-token prefix, growing together in 150
    blocks: vLLM preempts some, a preempted request resumes from cached blocks
    (its hit restored from a window checkpoint), and tokens stay the
    reference's. Under that pressure no new checkpoint fits, so the hit is the
    shared prefix's."""
    prefix = texts[11][:161]
    prompts = [prefix + texts[i][1000:1040 + 10 * i] for i in range(8)]
    params = greedy(96, logprobs=2)
    tight = engines(**TIGHT_ENGINE)  # the one the eviction test left
    seen = _spy_on_hits(tight)
    got = _run_in_order(tight, [[prefix], prompts], params)
    ref = _run_in_order(off(engines, SMALL_ENGINE), [[prefix], prompts], params)
    resumed = [hit for preemptions, hit in seen if preemptions > 0]
    print(f"lookups of resumed requests hit {sorted(set(resumed))} ({len(resumed)} lookups)")
    compare(got, ref, "APC with preemption vs APC off")
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.num_cached_tokens for o in got[1:]] == [160] * 8
    assert resumed, "no request was preempted: the pool no longer runs out"
    assert max(resumed) >= 160


@pytest.mark.parametrize("scheme", [
    {"scheme": "kivi"},
    {"artifact": str(REPO / "examples" / "artifacts" / "house-qwen3-tiered")},
])
def test_shared_prefix_with_other_schemes(scheme, engines, texts, greedy):
    """The KIVI-style (per-channel key groups, closed at block boundaries)
    and tiered page formats share the state blocks, so the same checkpoints."""
    kvq = {**SMALL, **scheme} if "artifact" in scheme else {"sink": SMALL["sink"], "window": SMALL["window"], **scheme}
    _shared_prefix_case(engines, dict(SMALL_ENGINE, oscar=kvq, max_model_len=1024), texts, greedy, prefix_len=270,
                        block=SMALL_BLOCK)
