"""The KIVI-style scheme inside real vLLM (CPU build) on house-qwen3: fp32
engines with a small sink and window and 64-token prefill chunks, against an
independent PyTorch model of the same quantization. Two engines, one after the
other: the plain reference point (fp16 key pairs) and int8 key pairs. (The
values' R_V fold is OSCAR's, checked in test_oscar_engine.py; folded in fp32 it
moves a bf16 value by an ulp now and then, which INT2 amplifies into the odd
greedy flip, so the exact comparison here keeps values unrotated.)"""

import pytest

from tests.conftest import make_llm, model_path, needles, shutdown

pytestmark = pytest.mark.slow

CONFIGS = {
    "plain": {"scheme": "kivi", "sink": 16, "window": 40},
    "int8 pairs": {"scheme": "kivi", "sink": 16, "window": 40, "key_pairs": "int8"},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def kivi(request):
    kvq = CONFIGS[request.param]
    llm = make_llm(oscar=kvq, dtype="float32", max_num_batched_tokens=64, max_model_len=2048)
    yield llm, kvq
    shutdown(llm)


def test_kivi_path_matches_standalone_pytorch(kivi, greedy):
    from tests.backends.kivi_standalone import KiviStandalone
    from tests.backends.oscar_standalone import assert_matches_standalone

    llm, kvq = kivi
    ref = KiviStandalone(model_path(), kvq["sink"], kvq["window"], kvq.get("key_pairs", "fp16"))
    prompts = [r["prompt"] for r in needles(max_tokens=1200, limit=4)]
    assert_matches_standalone(llm, prompts, ref, greedy(8, prompt_logprobs=0, logprobs=0), "KIVI")
