"""The tiered scheme inside real vLLM (CPU build) on house-qwen3: an fp32
engine with the calibrated tiered artifact (keys 48x4 + 80x2, values 16x4 +
48x2 + 64 directions not stored), a small sink and window and 64-token prefill
chunks, against the standalone PyTorch model of the same rows."""

import pytest

from tests.conftest import REPO, make_llm, model_path, needles, shutdown

pytestmark = pytest.mark.slow
ARTIFACT = REPO / "examples" / "artifacts" / "house-qwen3-tiered"
KVQ = {"scheme": "tiered", "artifact": str(ARTIFACT), "sink": 16, "window": 32}


@pytest.fixture(scope="module")
def tiered_llm():
    llm = make_llm(oscar=KVQ, dtype="float32", max_num_batched_tokens=64, max_model_len=2048)
    yield llm
    shutdown(llm)


def test_tiered_path_matches_standalone_pytorch(tiered_llm, greedy):
    from tests.backends.oscar_standalone import OscarStandalone
    from vllm_kvq.artifacts import OscarArtifact
    from vllm_kvq.kernels.tiered.reference import dequantize_tiers, quantize_tiers

    art = OscarArtifact.load(ARTIFACT)
    tiers = art.tiers

    def codec(kind, layer, head, rows):
        clip = (art.k_clip if kind == "k" else art.v_clip)[layer]
        fill = art.fill_for(kind, layer, [head])
        return dequantize_tiers(*quantize_tiers(rows, tiers[kind], clip), tiers[kind],
                                None if fill is None else fill[0])

    ref = OscarStandalone(model_path(), art, KVQ["sink"], KVQ["window"], 128, codec)
    prompts = [r["prompt"] for r in needles(max_tokens=1200, limit=4)]
    outs = tiered_llm.generate(prompts, greedy(8, prompt_logprobs=0, logprobs=0), use_tqdm=False)
    ids_all = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    logprobs = [ref.logprobs(ids) for ids in ids_all]
    ref.window = 1 << 20  # nothing quantized: the size of the effect being checked
    exact = [ref.logprobs(ids) for ids in ids_all]
    diffs, effect, agree, total = [], [], 0, 0
    for out, lp, lx in zip(outs, logprobs, exact):
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            tok = out.prompt_token_ids[i]
            diffs.append(abs(entry[tok].logprob - lp[i - 1, tok].item()))
            effect.append(abs(lx[i - 1, tok].item() - lp[i - 1, tok].item()))
        for j, tok in enumerate(out.outputs[0].token_ids):
            total += 1
            agree += int(lp[len(out.prompt_token_ids) - 1 + j].argmax().item() == tok)
    diffs.sort()
    mean, p99 = sum(diffs) / len(diffs), diffs[int(0.99 * len(diffs))]
    effect_mean = sum(effect) / len(effect)
    print(f"\nvLLM tiered vs standalone: {len(diffs)} prompt tokens, |dlogprob| mean {mean:.5f} p99 {p99:.5f}; "
          f"greedy agreement {agree}/{total}; tiered vs BF16 in the standalone model: mean {effect_mean:.5f}")
    assert mean < 0.1 * effect_mean and mean < 5e-3 and p99 < 3e-2
    assert agree == total


def test_tiered_pages_are_the_declared_size(tiered_llm):
    """80 B per token and KV head: 2.5 bits per quantized element."""
    cfg = tiered_llm.llm_engine.vllm_config.cache_config
    from vllm_kvq.kernels.formats import page_format
    from vllm_kvq.settings import OscarSettings

    fmt = page_format(128, cfg.block_size, OscarSettings(**KVQ))
    assert fmt.bytes_per_token == 80


@pytest.mark.parametrize("kvq, message", [
    ({"scheme": "tiered"}, "takes its tiers and rotations from kvq.artifact"),
    ({"scheme": "tiered", "artifact": str(ARTIFACT), "group_size": 64}, "drop kvq.rotation and kvq.group_size"),
    ({"artifact": str(ARTIFACT)}, "calibrated with tiers"),
    ({"scheme": "tiered", "artifact": str(ARTIFACT), "kernels": "triton"}, "PyTorch reference ops"),
])
def test_bad_tiered_settings_fail_at_start(kvq, message):
    with pytest.raises(Exception, match=message):
        make_llm(oscar=kvq)


def test_tiered_scheme_needs_an_artifact_with_tiers():
    with pytest.raises(Exception, match="has no tiers"):
        make_llm(oscar={"scheme": "tiered", "artifact": str(REPO / "examples" / "artifacts" / "house-qwen3-oscar")})
