"""The whole Triton path inside real vLLM, without a GPU.

``kernels: "triton"`` with ``TRITON_INTERPRET=1`` (inherited by the engine's
processes) runs the fused store, the extend kernel for the 64-token prefill
chunks and the split-KV decode in Triton's interpreter, with the metadata the
builder makes for CUDA. Its tokens and logprobs must match the reference path,
on a dense model and on a gated-delta-net hybrid, whose attention blocks vLLM
makes long (400 tokens here) to match its state pages, and with a tiered
artifact.
"""

import os

import pytest
import torch

from tests.conftest import REPO, make_llm, needles, shutdown

pytestmark = pytest.mark.slow

INT2 = {"rotation": "hadamard", "sink": 16, "window": 32, "k_clip": 0.96, "v_clip": 0.92}
POOL = {"state": "stepquant", "state_artifact": str(REPO / "examples" / "artifacts" / "house-qwen3next-stepquant")}
TIERED = {"artifact": str(REPO / "examples" / "artifacts" / "house-qwen3-tiered"), "sink": 16, "window": 32,
          "override_artifact": True}


def _run(kernels: str, prompts, params, model="house-qwen3next", kvq=INT2, **kw):
    llm = make_llm(model, oscar={**kvq, "kernels": kernels}, max_model_len=1024,
                   max_num_batched_tokens=64, enable_chunked_prefill=True, max_num_seqs=4, **kw)
    try:
        return llm.apply_model(_attention_block)[0], llm.generate(prompts, params, use_tqdm=False)
    finally:
        shutdown(llm)


def _attention_block(model) -> int:
    """Tokens per attention block as the worker allocated them (an OSCAR page
    is ``[blocks, H, KB, C]`` uint8; vLLM sizes hybrid blocks in the worker)."""
    for module in model.modules():
        kv = getattr(module, "kv_cache", None)
        for cache in kv if isinstance(kv, (list, tuple)) else [kv]:
            if isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.dtype == torch.uint8:
                return cache.shape[2]
    raise AssertionError("no OSCAR page found")


def _compare(greedy, monkeypatch, **kw):
    """Tokens equal and logprobs close, Triton (interpreted) against the reference ops."""
    pytest.importorskip("triton")
    prompts = [needles(max_tokens=4096)[0]["prompt"][:400], "def add(a, b):\n    return a + b\n\ndef mul(a, b):"]
    params = greedy(6, logprobs=1)
    monkeypatch.setitem(os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships a function
    block, ref = _run("reference", prompts, params, **kw)
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    _, got = _run("triton", prompts, params, **kw)
    assert len(ref[0].prompt_token_ids) > 64 + 16 + 32  # later chunks' queries read INT2 keys
    diffs = []
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg, tok in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, r.outputs[0].token_ids):
            diffs.append(abs(lr[tok].logprob - lg[tok].logprob))
    print(f"\nblock {block}: Triton vs reference |dlogprob| mean {sum(diffs) / len(diffs):.4f} max {max(diffs):.4f}")
    # the Triton kernels round operands to fp16: bit-equal logprobs would mean they never ran
    assert max(diffs) > 0
    return block, diffs


def test_triton_path_matches_reference_path(greedy, monkeypatch):
    _, diffs = _compare(greedy, monkeypatch, model="house-qwen3", dtype="float32")
    # fp16 tensor-core operands against the fp32 reference (measured: mean 0.017, max 0.095)
    assert max(diffs) < 0.2 and sum(diffs) / len(diffs) < 0.03


def test_tiered_triton_path_matches_reference_path(greedy, monkeypatch):
    """A tiered artifact (INT4, INT2 and not-stored tiers) through the same kernels."""
    _, diffs = _compare(greedy, monkeypatch, model="house-qwen3", dtype="float32", kvq=TIERED)
    assert max(diffs) < 0.2 and sum(diffs) / len(diffs) < 0.03


def test_hybrid_triton_path_with_state_pool(greedy, monkeypatch):
    """house-qwen3next's two attention layers through the Triton kernels at
    the hybrid's long blocks, its GDN states in the STEPQuant pool (the same
    pool in both runs, reference codec on CPU)."""
    block, diffs = _compare(greedy, monkeypatch, kvq={**INT2, **POOL}, dtype="bfloat16")
    # vLLM sizes the block to the packed state page: not a power of two, so decode's
    # and extend's last step a page is partial
    assert block >= 256 and block & (block - 1)
    # bf16 model (measured: mean 0.005, max 0.046)
    assert max(diffs) < 0.2 and sum(diffs) / len(diffs) < 0.03
