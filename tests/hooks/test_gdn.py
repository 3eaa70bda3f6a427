"""The gated-delta-net seam: which of vLLM's GDN batches the packed decode step takes."""


def test_decode_batches_only():
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from vllm_kvq.hooks.gdn import _is_decode_batch

    def md(decodes, prefills):
        return GDNAttentionMetadata(num_prefills=prefills, num_prefill_tokens=7 * prefills, num_decodes=decodes,
                                    num_decode_tokens=decodes, num_spec_decodes=0, num_spec_decode_tokens=0,
                                    num_actual_tokens=decodes + 7 * prefills)

    assert _is_decode_batch(md(4, 0))
    assert not _is_decode_batch(md(4, 1)) and not _is_decode_batch(md(0, 2))
