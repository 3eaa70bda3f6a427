"""Speculative decoding (ngram prompt lookup) with OSCAR as the target's
attention backend, in real vLLM on CPU.

A verification step writes the K/V rows of all 1 + k tokens before vLLM
knows which drafts it accepts. The INT2 rows of rejected drafts sit at
positions that later tokens overwrite, but their BF16 rows go into the
request's window ring, where with exactly W slots they would overwrite rows
still inside the window. So the ring keeps k spare slots, and greedy tokens
must equal those of the same engine without speculation. A cache that reads
wrong rows shows up as low acceptance, so the acceptance rate is held against
the unquantized cache's (CPU_ATTN) on the same prompts.

House-qwen3 in fp32 (no bf16 near ties), decode regime (64-token chunks),
sink 16 and window 32 so INT2 pages are read and drafts land inside the window.
"""

import os

import pytest

from tests.backends.test_state_pool import compare
from tests.conftest import REPO, make_llm, needles, shutdown

pytestmark = pytest.mark.slow
# vLLM's ngram proposer runs in numba threads, which on a few shared cores
# fight torch's threads and slow every step several times over
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

KVQ = {"artifact": str(REPO / "examples" / "artifacts" / "house-qwen3-oscar"), "sink": 16, "window": 32,
       "override_artifact": True}
DRAFTS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ENGINE = dict(dtype="float32", max_model_len=2048, max_num_batched_tokens=64, disable_log_stats=False)
# A broken cache lowers acceptance; beyond that, the two caches decode
# different continuations after a while, which moves the rate either way.
ACCEPTANCE_TOLERANCE = 0.1


def _spec_counts(llm) -> tuple[int, int]:
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def prompts():
    return [r["prompt"] for r in needles(max_tokens=1000, limit=8)]


def _generate(prompts, greedy, **kw):
    llm = make_llm(**ENGINE, **kw)
    try:
        outs = llm.generate(prompts, greedy(64, logprobs=2), use_tqdm=False)
        counts = _spec_counts(llm) if "speculative_config" in kw else None
    finally:
        shutdown(llm)
    return outs, counts


@pytest.fixture(scope="module")
def oscar_plain(prompts, greedy):
    return _generate(prompts, greedy, oscar=KVQ)[0]


@pytest.fixture(scope="module")
def oscar_ngram(prompts, greedy):
    return _generate(prompts, greedy, oscar=KVQ, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def unquantized_ngram(prompts, greedy):
    return _generate(prompts, greedy, speculative_config=NGRAM)


def test_ngram_gives_the_tokens_of_plain_decoding(oscar_plain, oscar_ngram):
    """Up to the first near tie (the project's rule), and in fp32 every token:
    the only difference left is the batch shape of 1 + k query rows."""
    outs, (drafted, accepted) = oscar_ngram
    compared, mean, worst = compare(outs, oscar_plain, "OSCAR ngram vs OSCAR without speculation")
    assert drafted > 0 and accepted > 0
    assert mean < 0.01 and worst < 0.05
    first_diff = [next((i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y),
                       None) for a, b in zip(outs, oscar_plain)]
    assert first_diff == [None] * len(outs)


def test_acceptance_matches_the_unquantized_cache(oscar_ngram, unquantized_ngram):
    (_, (drafted, accepted)), (_, (ref_drafted, ref_accepted)) = oscar_ngram, unquantized_ngram
    rate, ref_rate = accepted / drafted, ref_accepted / ref_drafted
    print(f"\nngram acceptance: OSCAR {accepted}/{drafted} = {rate:.3f}, "
          f"CPU_ATTN {ref_accepted}/{ref_drafted} = {ref_rate:.3f}")
    assert ref_rate > 0.2  # the prompts give ngram something to find
    assert rate >= ref_rate - ACCEPTANCE_TOLERANCE


def test_triton_kernels_refuse_speculative_decoding():
    """Their ring has no spare slots: refused before any engine starts."""
    with pytest.raises(Exception, match="kvq.kernels 'reference'"):
        make_llm(oscar={**KVQ, "kernels": "triton"}, speculative_config=NGRAM, **ENGINE)
