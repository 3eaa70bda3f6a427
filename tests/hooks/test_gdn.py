"""The gated-delta-net seam: which rows of vLLM's GDN batches the packed
decode step takes, and what the staged rest of a batch reads and writes."""

import pytest
import torch


def metadata(decodes, prefills, **tensors):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    return GDNAttentionMetadata(num_prefills=prefills, num_prefill_tokens=7 * prefills, num_decodes=decodes,
                                num_decode_tokens=decodes, num_spec_decodes=0, num_spec_decode_tokens=0,
                                num_actual_tokens=decodes + 7 * prefills, **tensors)


def test_split_step_rows():
    from vllm_kvq.hooks.gdn import _split_step_rows

    assert _split_step_rows(metadata(4, 0)) == "all"
    assert _split_step_rows(metadata(4, 1)) == "decodes"
    assert _split_step_rows(metadata(0, 2)) is None
    assert _split_step_rows(metadata(4, 0, spec_sequence_masks=torch.ones(4, dtype=torch.bool))) is None


@pytest.mark.parametrize("decodes_in_place", [False, True])
def test_staging_a_mixed_batch(decodes_in_place):
    """Pivot heads store fp16 values as they are, so what a record holds is
    read here from its bytes. Decode slots 5, 2, 7; prefill slots 4 (with
    a state) and 6 (fresh)."""
    from types import SimpleNamespace

    from vllm_kvq.backends.state_pool import LayerPool
    from vllm_kvq.hooks.gdn import _stage
    from vllm_kvq.kernels.stepquant.format import StateLayout

    heads, k, v = 2, 4, 32
    lay = StateLayout((16,) * heads, k, v)
    pool = LayerPool(lay, torch.ones(heads, k), "stepquant", torch.float32)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(9, heads, k, v, generator=gen).half()
    records = values.view(9, -1).view(torch.uint8).clone()
    assert records.shape[1] == lay.size
    conv = torch.randn(9, 3, 8, generator=gen)
    slots = torch.tensor([5, 2, 7, 4, 6], dtype=torch.int32)
    md = metadata(3, 2, non_spec_state_indices_tensor=slots, prefill_state_indices=slots[3:],
                  has_initial_state=torch.tensor([True, True, True, True, False]))
    layer = SimpleNamespace(kv_cache=(conv, records))
    before = records.clone()

    proxy, staged_md, finish = _stage(layer, md, pool, decodes_in_place=decodes_in_place)
    conv_scratch, scratch = proxy.kv_cache
    staged = scratch.view(-1, heads, k, v)  # the CPU kernels' [HV, K, V] bytes
    first = 1 if decodes_in_place else 4  # the scratch row of the first prefill
    assert staged.shape[0] == (3 if decodes_in_place else 6)
    assert staged_md.non_spec_state_indices_tensor.tolist() == [1, 2, 3, 4, 5]
    assert staged_md.prefill_state_indices.tolist() == [first, first + 1]
    assert staged[first].equal(values[4].float()) and not staged[first + 1].any()  # slot 6 starts from zeros
    if not decodes_in_place:
        assert all(staged[1 + i].equal(values[s].float()) for i, s in enumerate((5, 2, 7)))
    assert conv_scratch[1:].equal(conv[slots.long()])

    staged[first:first + 2] += 1.0
    conv_scratch[1:] *= 2
    want_conv = conv[slots.long()] * 2
    finish()
    got = records.view(torch.float16).view(9, heads, k, v)
    assert got[4].equal((values[4].float() + 1).half()) and got[6].equal(torch.ones(heads, k, v).half())
    for s in (5, 2, 7):  # the decode rows: untouched when the split step takes them
        assert records[s].equal(before[s])
    assert conv[slots.long()].equal(want_conv)
