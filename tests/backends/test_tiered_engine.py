"""A tiered artifact inside real vLLM (CPU build) on house-qwen3: an fp32
engine with the calibrated tiers (keys 48x4 + 80x2, values 16x4 + 48x2 + 64
directions not stored), a small sink and window and 64-token prefill chunks,
against the standalone PyTorch model with its own tier codec."""

import os

import pytest

from tests.conftest import REPO, make_llm, model_path, needles, shutdown

pytestmark = pytest.mark.slow
ARTIFACT = REPO / "examples" / "artifacts" / "house-qwen3-tiered"
KVQ = {"artifact": str(ARTIFACT), "sink": 16, "window": 32, "override_artifact": True}
K_TIERS, V_TIERS = [(48, 4), (80, 2)], [(16, 4), (48, 2), (64, 0)]


@pytest.fixture(scope="module")
def tiered_llm():
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function to the engine
    llm = make_llm(oscar=KVQ, dtype="float32", max_num_batched_tokens=64, max_model_len=2048)
    yield llm
    shutdown(llm)


def test_tiered_path_matches_standalone_pytorch(tiered_llm, greedy):
    from tests.backends.oscar_standalone import OscarStandalone, assert_matches_standalone, naive_tiers
    from vllm_kvq.artifacts import OscarArtifact

    art = OscarArtifact.load(ARTIFACT)

    def codec(kind, layer, head, rows):
        clip = (art.k_clip if kind == "k" else art.v_clip)[layer]
        fill = art.fill[kind][layer][head] if layer in art.fill.get(kind, {}) else None
        return naive_tiers(rows, K_TIERS if kind == "k" else V_TIERS, clip, fill)

    ref = OscarStandalone(model_path(), art, KVQ["sink"], KVQ["window"], codec)
    prompts = [r["prompt"] for r in needles(max_tokens=1200, limit=4)]
    assert_matches_standalone(tiered_llm, prompts, ref, greedy(8, prompt_logprobs=0, logprobs=0), "tiered")


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


def test_layers_hold_80_byte_rows_and_the_calibrated_fills(tiered_llm, greedy):
    """What vLLM really allocated and bound: every attention layer's cache has
    80 B per token and KV head (2.5 bits per element), and its 0-bit value
    tiers read the artifact's calibrated means."""
    import torch
    from safetensors.torch import load_file

    tiered_llm.generate(["def main():"], greedy(2), use_tqdm=False)  # layers bind their artifact on first use
    layers = tiered_llm.apply_model(bound_layers)[0]
    tensors = load_file(str(ARTIFACT / "tensors.safetensors"))
    assert sorted(layer for layer, *_ in layers) == list(range(6))
    for layer, shape, k_fill, v_fill in layers:
        assert shape[1:] == [2, shape[2], 80]  # [blocks, KV heads, block size, C]
        assert k_fill is None
        assert torch.equal(torch.tensor(v_fill), tensors[f"v_fill.{layer}"])
