"""A tiered artifact inside real vLLM (CPU build) on house-qwen3: an fp32
engine with the calibrated tiers (keys 48x4 + 80x2, values 16x4 + 48x2 + 64
directions not stored), a small sink and window and 64-token prefill chunks,
against the standalone PyTorch model with its own tier codec."""

import pytest

from tests.conftest import REPO, model_path, needles

pytestmark = pytest.mark.slow
ARTIFACT = REPO / "examples" / "artifacts" / "house-qwen3-tiered"
KVQ = {"artifact": str(ARTIFACT), "sink": 16, "window": 32, "override_artifact": True}
TIERED = dict(oscar=KVQ, dtype="float32", max_num_batched_tokens=64, max_model_len=2048)
K_TIERS, V_TIERS = [(48, 4), (80, 2)], [(16, 4), (48, 2), (64, 0)]


def test_tiered_path_matches_standalone_pytorch(engines, greedy):
    from tests.backends.oscar_standalone import OscarStandalone, assert_matches_standalone, naive_tiers
    from vllm_kvq.artifacts import OscarArtifact

    art = OscarArtifact.load(ARTIFACT)

    def codec(kind, layer, head, rows):
        clip = (art.k_clip if kind == "k" else art.v_clip)[layer]
        fill = art.fill[kind][layer][head] if layer in art.fill.get(kind, {}) else None
        return naive_tiers(rows, K_TIERS if kind == "k" else V_TIERS, clip, fill)

    ref = OscarStandalone(model_path(), art, KVQ["sink"], KVQ["window"], codec)
    prompts = [r["prompt"] for r in needles(max_tokens=1200, limit=2)]
    assert_matches_standalone(engines(**TIERED), prompts, ref, greedy(8, prompt_logprobs=0, logprobs=0), "tiered")


def bound_layers(model) -> list:
    """Per OSCAR layer of a loaded model (``LLM.apply_model``): its index, the
    shape of its cache and the 0-bit means it bound."""
    layers = []
    for m in model.modules():
        impl = getattr(m, "impl", None)
        if impl is not None and hasattr(impl, "codec"):
            kv = m.kv_cache[0] if isinstance(m.kv_cache, (list, tuple)) else m.kv_cache
            k_fill, v_fill = impl.codec.fills
            layers.append((impl._layer, list(kv.shape), k_fill, v_fill.tolist()))
    return layers


def test_layers_hold_80_byte_rows_and_the_calibrated_fills(engines, greedy):
    """What vLLM really allocated and bound: every attention layer's cache has
    80 B per token and KV head (2.5 bits per element) in blocks of the size
    vLLM chose, and its 0-bit value tiers read the artifact's calibrated means."""
    import torch
    from safetensors.torch import load_file

    llm = engines(**TIERED)
    llm.generate(["def main():"], greedy(2), use_tqdm=False)  # layers bind their artifact on first use
    layers = llm.apply_model(bound_layers)[0]
    block = llm.llm_engine.vllm_config.cache_config.block_size
    tensors = load_file(str(ARTIFACT / "tensors.safetensors"))
    assert sorted(layer for layer, *_ in layers) == list(range(6))
    for layer, shape, k_fill, v_fill in layers:
        assert shape[1:] == [2, block, 80]  # [blocks, KV heads, block size, C]
        assert k_fill is None
        assert torch.equal(torch.tensor(v_fill), tensors[f"v_fill.{layer}"])
