"""OSCAR on the full-attention layers of a gated-delta-net hybrid
(house-qwen3next: 6 GDN layers, 2 gated full-attention layers with partial
RoPE), the GDN layers keeping vLLM's own state, in real vLLM on CPU.

Calibration captures the attention layers only (``vllm-kvq calibrate`` finds
them from ``layer_types``). vLLM sizes hybrid attention blocks so one
attention page is at least one GDN state page; OSCAR's small per-token size
makes those blocks long (1024 tokens here), and the per-request sink/window
state blocks must not eat the saving. Qwen3-Next gates the attention output channel by channel before
o_proj, so R_V is folded into the V rows only and the backend un-rotates.
"""

import pytest

from evalkit.compare import compare
from evalkit.data import CODE
from tests.conftest import make_llm, model_path, needles, shutdown

pytestmark = pytest.mark.slow
MODEL = "house-qwen3next"
MAX_LEN = 8192


def generate(greedy, prompts, **kw):
    # bf16 GDN states: vLLM's "auto" picks fp32 or bf16 depending on the CPU's
    # bf16 support, and the state size decides how long hybrid blocks are
    llm = make_llm(MODEL, dtype="bfloat16", max_model_len=MAX_LEN, mamba_ssm_cache_dtype="bfloat16", **kw)
    try:
        cap = llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
        return cap, llm.generate(prompts, greedy(16, logprobs=2), use_tqdm=False)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """Per-KV-head rotations of the two attention layers, from ``vllm-kvq calibrate``."""
    from vllm_kvq.calib.calibrate import INT2, calibrate

    out = tmp_path_factory.mktemp("qwen3next-artifact")
    calibrate(model_path(MODEL), str(CODE), str(out), tokens=2048, seq_len=512, tiers=INT2)
    return out


def test_hybrid_exact_while_everything_is_bf16_and_capacity(greedy, artifact):
    short = [r["prompt"][:600] for r in needles(limit=4)]  # sink + window cover them
    cap_ref, ref = generate(greedy, short, attention_backend="CPU_ATTN")
    cap, got = generate(greedy, short, oscar={"artifact": str(artifact)})
    assert all(len(b.prompt_token_ids) + 16 <= 64 + 256 for b in ref)
    out = compare(got, ref)
    assert out["whole_sequences_equal"] == len(short)
    assert out["dlogprob_mean"] < 0.02 and out["dlogprob_max"] < 0.1
    # same KV budget: attention pages shrink 7x (INT2: 72 B per token and head against 512), the
    # GDN states stay per request, so the whole cache holds 4x the tokens
    assert cap >= 4 * cap_ref
