"""A GLM-4.x MoE model (Glm4MoeForCausalLM: partial RoPE, q/k norm, QKV bias,
routed + shared experts) served with OSCAR in real vLLM on CPU.

The checkpoint is a tiny random one built here with transformers and the
house tokenizer, calibrated with ``vllm-kvq calibrate`` (statistics captured
after GLM's partial RoPE), then served: with sink + window covering every
token, OSCAR's greedy tokens equal CPU_ATTN's, so per-KV-head rotations of
q/k after partial RoPE and the value fold into the biased QKV and o_proj are
exact.
"""

import shutil

import pytest

from tests.conftest import EVAL, MODELS, make_llm, shutdown

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    out = tmp_path_factory.mktemp("glm4-moe-tiny")
    config = Glm4MoeConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, partial_rotary_factor=0.5, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.08,
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )
    torch.manual_seed(0)
    Glm4MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODELS / "house-qwen3" / name, out / name)
    return out


@pytest.fixture(scope="module")
def glm_artifact(glm_dir, tmp_path_factory):
    from vllm_kvq.calib.calibrate import calibrate

    out = tmp_path_factory.mktemp("glm-artifact")
    calibrate(str(glm_dir), str(EVAL / "code-dev.txt.gz"), str(out), tokens=2048, seq_len=512)
    return out


def prompts():
    import json

    rows = [json.loads(line) for line in (EVAL / "needles-dev.jsonl").open()][:4]
    return [r["prompt"][:1200] for r in rows]


def run(glm_dir, greedy, **kw):
    llm = make_llm(str(glm_dir), dtype="float32", max_model_len=1024, **kw)
    try:
        return llm.generate(prompts(), greedy(16, logprobs=1), use_tqdm=False)
    finally:
        shutdown(llm)


def test_calibrated_glm_is_exact_while_everything_is_bf16(glm_dir, glm_artifact, greedy):
    from vllm_kvq.artifacts import OscarArtifact

    art = OscarArtifact.load(glm_artifact)
    assert art.fingerprint["architecture"] == "Glm4MoeForCausalLM"
    assert art.granularity == "kv_head" and art.k_rotation[0].shape == (2, 128, 128)
    ref = run(glm_dir, greedy, attention_backend="CPU_ATTN")
    got = run(glm_dir, greedy, oscar={"artifact": str(glm_artifact), "sink": 512, "window": 512,
                                                 "override_artifact": True})
    diffs = []
    for a, b in zip(got, ref):
        assert len(b.prompt_token_ids) + 16 <= 1024
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diffs += [abs(la[t].logprob - lb[t].logprob)
                  for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, b.outputs[0].token_ids)]
    print(f"\nlogprob |diff| mean {sum(diffs) / len(diffs):.4f} max {max(diffs):.4f} over {len(diffs)} tokens")
    # the cache keeps K/V rows in BF16 while CPU_ATTN runs fp32: the bound of the house-model exactness test
    assert sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.1
