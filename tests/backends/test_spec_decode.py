"""Speculative decoding with OSCAR as the target's attention backend, in real
vLLM on CPU: ngram (prompt lookup) and EAGLE-3.

A verification step writes the K/V rows of all 1 + k tokens before vLLM
knows which drafts it accepts. The INT2 rows of rejected drafts sit at
positions that later tokens overwrite, but their BF16 rows go into the
request's window ring, where with exactly W slots they would overwrite rows
still inside the window. So the ring keeps k spare slots, and greedy tokens
must equal those of the same engine without speculation. A cache that reads
wrong rows shows up as low acceptance, so the acceptance rate is held against
the unquantized cache's (CPU_ATTN) on the same prompts. With ``kernels:
"triton"`` the verification steps run through the decode kernel (Triton's
interpreter here) and must give the reference ops' tokens.

House-qwen3 in fp32 (no bf16 near ties), decode regime (64-token chunks),
sink 16 and window 32 so INT2 pages are read and drafts land inside the window.
"""

import os

import pytest
import torch

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
    return [r["prompt"] for r in needles(max_tokens=600, limit=8)]


def _generate(prompts, greedy, **kw):
    llm = make_llm(**ENGINE, **kw)
    try:
        outs = llm.generate(prompts, greedy(64, logprobs=2), use_tqdm=False)
        counts = _spec_counts(llm) if "speculative_config" in kw else None
    finally:
        shutdown(llm)
    return outs, counts


@pytest.fixture(scope="module")
def oscar_plain(prompts, greedy, engines):
    return engines(oscar=KVQ, **ENGINE).generate(prompts, greedy(64, logprobs=2), use_tqdm=False)


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


_LAUNCHES: list[int] = []  # query_len of each decode-kernel launch, in the worker that counts them


def _count_decode_launches(model) -> None:
    """In a worker: count the decode kernel's launches by their query rows a request."""
    from vllm_kvq.kernels.oscar import triton_decode

    decode = triton_decode.decode_attention

    def counted(q, *args, query_len=1, **kw):
        _LAUNCHES.append(query_len)
        return decode(q, *args, query_len=query_len, **kw)

    triton_decode.decode_attention = counted


def _decode_launches(model) -> list[int]:
    return list(_LAUNCHES)


# The Triton tests' settings: two short prompts that ngram finds drafts in,
# sink 8 and window 16 so INT2 pages are read within 16 tokens
TRITON_PROMPTS = ["def add(a, b):\n    return a + b\n\n" * 3 + "def add3(a, b, c):",
                  "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = ["]
TRITON_KVQ = {**KVQ, "sink": 8, "window": 16}
TRITON_ENGINE = dict(ENGINE, max_model_len=256, max_num_seqs=2)


@pytest.fixture(scope="module")
def reference_ops_plain(greedy, engines):
    """The reference ops without speculation on the Triton tests' prompts
    (speculation gives these tokens there: test_ngram_gives_the_tokens_of_plain_decoding)."""
    llm = engines(oscar={**TRITON_KVQ, "kernels": "reference"}, **TRITON_ENGINE)
    return llm.generate(TRITON_PROMPTS, greedy(16, logprobs=2), use_tqdm=False)


def test_triton_kernels_verify_drafts_in_the_decode_kernel(greedy, reference_ops_plain, monkeypatch):
    """``kernels: "triton"`` (Triton's interpreter on CPU, inherited by the
    engine's processes) with ngram: the verification steps' 1 + k query rows
    a request go through the decode kernel (each row its own window edge,
    over a ring of W + k slots), and the greedy tokens equal the reference
    ops'."""
    pytest.importorskip("triton")
    monkeypatch.setitem(os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships functions
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    llm = make_llm(oscar={**TRITON_KVQ, "kernels": "triton"}, **TRITON_ENGINE, speculative_config=NGRAM)
    try:
        llm.apply_model(_count_decode_launches)
        outs = llm.generate(TRITON_PROMPTS, greedy(16, logprobs=2), use_tqdm=False)
        drafted, accepted = _spec_counts(llm)
        launches = llm.apply_model(_decode_launches)[0]
    finally:
        shutdown(llm)
    compared, mean, worst = compare(outs, reference_ops_plain, "ngram: Triton vs reference ops")
    assert compared >= 24  # more than one whole output before any near tie
    assert drafted > 0 and accepted > 0
    assert max(launches) == 1 + DRAFTS  # whole verification steps took the decode kernel


def _eagle3_head(where) -> str:
    """A one-layer EAGLE-3 draft head for house-qwen3 with random weights (no
    trained head exists for it): its drafts are nearly all rejected, so every
    verification step writes k rows that the next step overwrites."""
    import json

    from safetensors.torch import save_file

    config = json.loads((REPO / "examples" / "models" / "house-qwen3" / "config.json").read_text())
    h, heads, kv, d = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)  # noqa: E731
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    layer = {"self_attn.q_proj": rand(heads * d, 2 * h), "self_attn.k_proj": rand(kv * d, 2 * h),
             "self_attn.v_proj": rand(kv * d, 2 * h), "self_attn.o_proj": rand(h, heads * d),
             "self_attn.q_norm": ones(d), "self_attn.k_norm": ones(d), "mlp.gate_proj": rand(inter, h),
             "mlp.up_proj": rand(inter, h), "mlp.down_proj": rand(h, inter), "input_layernorm": ones(h),
             "hidden_norm": ones(h), "post_attention_layernorm": ones(h)}
    weights = {f"midlayer.{k}.weight": v for k, v in layer.items()}
    weights.update({"fc.weight": rand(h, 3 * h), "norm.weight": ones(h), "lm_head.weight": rand(vocab, h)})
    save_file(weights, str(where / "model.safetensors"))
    config.update(architectures=["Eagle3Qwen3ForCausalLM"], num_hidden_layers=1, tie_word_embeddings=False,
                  eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    config.pop("layer_types", None)
    (where / "config.json").write_text(json.dumps(config))
    return str(where)


def test_eagle3_rejected_drafts_leave_the_tokens(tmp_path, greedy, engines):
    """EAGLE-3 with OSCAR as the target's backend (the draft's own layer keeps
    vLLM's BF16 cache): with a random head every step verifies 1 + k tokens
    and rejects the k drafts, whose rows the ring's spare slots absorb; the
    greedy tokens equal those without speculation, every one (fp32)."""
    head = _eagle3_head(tmp_path)
    prompts = [r["prompt"] for r in needles(max_tokens=600, limit=2)]
    plain = engines(oscar=KVQ, **ENGINE).generate(prompts, greedy(32), use_tqdm=False)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": DRAFTS}
    llm = make_llm(oscar=KVQ, **dict(ENGINE, max_model_len=1536), speculative_config=spec)
    try:
        eagle3 = llm.generate(prompts, greedy(32), use_tqdm=False)
        drafted, _ = _spec_counts(llm)
    finally:
        shutdown(llm)
    assert drafted >= DRAFTS * 16  # most steps verified drafts
    assert [o.outputs[0].token_ids for o in eagle3] == [o.outputs[0].token_ids for o in plain]


def _unified_pages(cfg):
    """OSCAR's spec of a target layer and vLLM's of the draft's, as vLLM's
    allocator unifies them into one block pool."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvq.backends.oscar import OscarBackend

    full = FullAttentionSpec(block_size=cfg.cache_config.block_size, num_kv_heads=2, head_size=128,
                             dtype=torch.float32)
    with set_current_vllm_config(cfg):
        target = OscarBackend.customize_spec(full)
    return unify_kv_cache_spec_page_size({"target": target, "draft": full})


def test_draft_layers_share_the_pool_unpadded(tmp_path):
    """An EAGLE-3 head's fp32 layer (2 KV heads of 128: 2,048 B a token) and
    OSCAR INT2 (144 B a token) in one pool: OSCAR's blocks grow to the first
    whole number of draft pages and vLLM grows the draft's blocks to match, so
    neither page is padded (padded OSCAR pages held 7x fewer tokens)."""
    from tests.conftest import engine_config

    spec = {"method": "eagle3", "model": _eagle3_head(tmp_path), "num_speculative_tokens": DRAFTS}
    cfg = engine_config(oscar=KVQ, speculative_config=spec, **ENGINE)
    block = cfg.cache_config.block_size
    assert block == 32  # the smallest block both OSCAR (16) and the draft's CPU_ATTN (32) take
    oscar_tokens = next(b for b in range(block, 1 << 20, block) if b * 144 % (block * 2048) == 0)
    specs = _unified_pages(cfg)
    assert specs["target"].block_size == oscar_tokens == 4096
    assert specs["draft"].block_size == oscar_tokens * 144 // 2048 == 288
    assert specs["target"].page_size_bytes == specs["draft"].page_size_bytes == 4096 * 144
    assert specs["target"].page_size_padded is None and specs["draft"].page_size_padded is None


def test_triton_kernels_beside_a_draft_heads_pages(tmp_path, greedy, reference_ops_plain, monkeypatch):
    """EAGLE-3's draft layer shares the block pool, OSCAR's blocks sized to a
    whole number of its pages: the Triton kernels (the interpreter here) on
    those blocks give the reference ops' greedy tokens without speculation
    (fp32, the random head's drafts all rejected), on unpadded pages."""
    pytest.importorskip("triton")
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    spec = {"method": "eagle3", "model": _eagle3_head(tmp_path), "num_speculative_tokens": DRAFTS}
    llm = make_llm(oscar={**TRITON_KVQ, "kernels": "triton"}, **dict(TRITON_ENGINE, max_num_seqs=1),
                   speculative_config=spec)
    try:
        got = llm.generate(TRITON_PROMPTS[:1], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
        drafted = _spec_counts(llm)[0]
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    finally:
        shutdown(llm)
    assert drafted >= DRAFTS * 6  # most of the 7 steps after the first token verified drafts
    assert list(got) == list(reference_ops_plain[0].outputs[0].token_ids[:8])
    assert sorted({g.kv_cache_spec.block_size for g in groups}) == [288, 4096]
    assert all(g.kv_cache_spec.page_size_padded is None for g in groups)


def test_oscar_draft_layers_are_refused(tmp_path):
    """A draft model's layers have no rotations in the artifact: asking for
    OSCAR there fails at start and names the fix."""
    from tests.conftest import engine_config

    spec = {"method": "eagle3", "model": _eagle3_head(tmp_path), "num_speculative_tokens": DRAFTS,
            "attention_backend": "OSCAR"}
    with pytest.raises(Exception, match="drop attention_backend from the speculative config"):
        engine_config(oscar=KVQ, speculative_config=spec, **ENGINE)
