"""The whole Triton path inside real vLLM, without a GPU.

``kernels: "triton"`` with ``TRITON_INTERPRET=1`` (set by conftest) runs the
fused store, the extend kernel for the 64-token prefill chunks and the
split-KV decode in Triton's interpreter, with
the metadata the builder makes for CUDA. Its tokens and logprobs must match
the reference path (the engines of test_oscar_engine and test_tiered_engine),
on a dense model and on a gated-delta-net hybrid, whose attention blocks vLLM
makes long (400 tokens here) to match its state pages, and with a tiered
artifact.
"""

import pytest
import torch

from evalkit.compare import compare
from tests.backends.test_oscar_engine import INT2_SMALL_CHUNKS
from tests.backends.test_tiered_engine import TIERED
from tests.conftest import REPO, make_llm, needles, shutdown

pytestmark = pytest.mark.slow

POOL = {"state": "stepquant", "state_artifact": str(REPO / "examples" / "artifacts" / "house-qwen3next-stepquant")}
HADAMARD_INT2 = {"rotation": "hadamard", "sink": 16, "window": 32, "k_clip": 0.96, "v_clip": 0.92}
HYBRID = dict(model="house-qwen3next", oscar={**HADAMARD_INT2, **POOL}, dtype="bfloat16", max_model_len=1024,
              max_num_batched_tokens=64)


# The decode kernel cuts a request's INT2 range into max_model_len / 512
# slices (num_splits): at 4096, eight programs a request and KV head, seven of
# them past these prompts' one INT2 page, each loading its queries in Triton's
# interpreter. At 1024, two: one reads the page, one is empty for the merge.
SHORT = dict(max_model_len=1024)


def with_triton(config: dict) -> dict:
    return dict(config, oscar={**config["oscar"], "kernels": "triton"})


def _attention_block(model) -> int:
    """Tokens per attention block as the worker allocated them (an OSCAR page
    is ``[blocks, H, KB, C]`` uint8; vLLM sizes hybrid blocks in the worker)."""
    for module in model.modules():
        kv = getattr(module, "kv_cache", None)
        for cache in kv if isinstance(kv, (list, tuple)) else [kv]:
            if isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.dtype == torch.uint8:
                return cache.shape[2]
    raise AssertionError("no OSCAR page found")


def _compare(reference, config: dict, greedy) -> tuple[int, dict]:
    """(attention block, comparison) of Triton (interpreted) against the reference engine."""
    pytest.importorskip("triton")
    prompts = [needles(max_tokens=4096)[0]["prompt"][:400], "def add(a, b):\n    return a + b\n\ndef mul(a, b):"]
    params = greedy(6, logprobs=1)
    block, ref = reference.apply_model(_attention_block)[0], reference.generate(prompts, params, use_tqdm=False)
    llm = make_llm(**with_triton(config))
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        shutdown(llm)
    assert len(ref[0].prompt_token_ids) > 64 + 16 + 32  # later chunks' queries read INT2 keys
    out = compare(got, ref)
    assert out["whole_sequences_equal"] == len(prompts)
    # the Triton kernels round operands to fp16: bit-equal logprobs would mean they never ran
    assert out["dlogprob_max"] > 0
    return block, out


def test_triton_path_matches_reference_path(engines, greedy):
    config = dict(INT2_SMALL_CHUNKS, **SHORT)
    _, out = _compare(engines(**config), config, greedy)
    # fp16 tensor-core operands against the fp32 reference (measured: mean 0.017, max 0.095)
    assert out["dlogprob_max"] < 0.2 and out["dlogprob_mean"] < 0.03


def test_tiered_triton_path_matches_reference_path(engines, greedy):
    """A tiered artifact (INT4, INT2 and not-stored tiers) through the same kernels."""
    config = dict(TIERED, **SHORT)
    _, out = _compare(engines(**config), config, greedy)
    assert out["dlogprob_max"] < 0.2 and out["dlogprob_mean"] < 0.03


def test_hybrid_triton_path_with_state_pool(greedy):
    """house-qwen3next's two attention layers through the Triton kernels at
    the hybrid's long blocks, its GDN states in the STEPQuant pool (the same
    pool in both runs, reference codec on CPU)."""
    reference = make_llm(**HYBRID)
    try:
        block, out = _compare(reference, HYBRID, greedy)
    finally:
        shutdown(reference)
    # vLLM sizes the block to the packed state page: not a power of two, so decode's
    # and extend's last step a page is partial
    assert block >= 256 and block & (block - 1)
    # bf16 model (measured: mean 0.005, max 0.046)
    assert out["dlogprob_max"] < 0.2 and out["dlogprob_mean"] < 0.03
