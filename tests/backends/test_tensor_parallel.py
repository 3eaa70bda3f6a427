"""TP=2 (multiprocessing executor on CPU) gives TP=1's tokens."""

import pytest

from tests.conftest import make_llm, needles, shutdown

pytestmark = pytest.mark.slow
KVQ = {"rotation": "hadamard", "sink": 16, "window": 32, "k_clip": 0.96, "v_clip": 0.92}


def test_tp2_equals_tp1(greedy, monkeypatch):
    prompts = [r["prompt"] for r in needles(max_tokens=900, limit=4)]
    one = make_llm(oscar=KVQ, dtype="float32", max_model_len=2048)
    try:
        ref = one.generate(prompts, greedy(24), use_tqdm=False)
    finally:
        shutdown(one)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    two = make_llm(oscar=KVQ, dtype="float32", max_model_len=2048, tensor_parallel_size=2,
                   distributed_executor_backend="mp")
    try:
        got = two.generate(prompts, greedy(24), use_tqdm=False)
    finally:
        shutdown(two)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
