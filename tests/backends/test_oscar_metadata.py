"""The OSCAR metadata builder's Triton path on vLLM's own CommonAttentionMetadata.

A full CUDA graph keeps the tensors of the metadata built at capture and
replays later batches through them, so decode metadata must be views of the
buffers vLLM's model runner rewrites in place every step (seq_lens, block
table, slot mapping) and nothing built per step. The batches here are laid out
as GPUModelRunner lays them out (decodes first; a padded decode batch has
query_start_loc repeating its last value, seq_len 0, a NULL block-table row and
slot -1 for every padding row); the tensors live on the CPU.
"""

import pytest
import torch

from vllm_kvq.kernels.oscar.triton_extend import query_tiles

MAX_REQS, MAX_TOKENS, WIDTH = 16, 64, 8


def _config(**kvq):
    from vllm.config import VllmConfig

    return VllmConfig(additional_config={"kvq": {"rotation": "hadamard", **kvq}})


def _builder(**kvq):
    from vllm_kvq.backends.oscar import OscarMetadataBuilder

    return OscarMetadataBuilder(None, ["model.layers.0.self_attn.attn"], _config(**kvq), torch.device("cpu"))


class RunnerBuffers:
    """The persistent inputs of vLLM's GPUModelRunner, refilled as it refills them."""

    def __init__(self):
        self.qsl = torch.zeros(MAX_REQS + 1, dtype=torch.int32)
        self.qsl_cpu = torch.zeros(MAX_REQS + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(MAX_REQS, dtype=torch.int32)
        self.seq_lens_cpu = torch.zeros(MAX_REQS, dtype=torch.int32)
        self.block_table = torch.zeros(MAX_REQS, WIDTH, dtype=torch.int32)
        self.slots = torch.zeros(MAX_TOKENS, dtype=torch.int64)

    def step(self, query_lens, seq_lens, pad_to=None):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n, n_pad = len(query_lens), pad_to or len(query_lens)
        cu = torch.tensor(query_lens).cumsum(0)
        nt = int(cu[-1])
        nt_pad = nt + (n_pad - n)  # one token per padding request (uniform decode)
        self.qsl_cpu[0] = 0
        self.qsl_cpu[1:n + 1] = cu
        self.qsl_cpu[n + 1:] = nt
        self.qsl.copy_(self.qsl_cpu)
        self.seq_lens[:n] = torch.tensor(seq_lens)
        self.seq_lens[n:] = 0
        self.seq_lens_cpu.copy_(self.seq_lens)
        for i, s in enumerate(seq_lens):  # distinct blocks per request
            self.block_table[i] = torch.arange(WIDTH, dtype=torch.int32) + 1 + 100 * i + s
        self.block_table[n:n_pad] = 0  # NULL_BLOCK_ID
        self.slots[:nt] = torch.arange(nt) + 7
        self.slots[nt:nt_pad] = -1
        return CommonAttentionMetadata(
            query_start_loc=self.qsl[:n_pad + 1], query_start_loc_cpu=self.qsl_cpu[:n_pad + 1],
            seq_lens=self.seq_lens[:n_pad], seq_lens_cpu_upper_bound=self.seq_lens_cpu[:n_pad],
            num_reqs=n_pad, num_actual_tokens=nt_pad, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_table_tensor=self.block_table[:n_pad], slot_mapping=self.slots[:nt_pad])


def test_decode_metadata_is_views_of_the_runner_buffers():
    """The metadata built at 'capture' (a padded batch of 5 decodes in 8 rows)
    reads the next step's batch (7 other decodes) once vLLM has refilled its
    buffers: nothing of it was computed at build time."""
    builder, buf = _builder(kernels="triton"), RunnerBuffers()
    captured = builder.build(0, buf.step([1] * 5, [3, 40, 1, 200, 17], pad_to=8))
    assert captured.triton and captured.num_decodes == 8 and captured.num_actual_tokens == 8
    assert captured.chunks is None
    assert captured.decode_seq_lens.tolist() == [3, 40, 1, 200, 17, 0, 0, 0]
    assert captured.decode_slots.tolist() == [7, 8, 9, 10, 11, -1, -1, -1]
    assert captured.block_table[5:].eq(0).all()
    for got, buffer in ((captured.decode_seq_lens, buf.seq_lens), (captured.decode_slots, buf.slots),
                        (captured.block_table, buf.block_table)):
        assert got.data_ptr() == buffer.data_ptr()

    replay = builder.build(0, buf.step([1] * 7, [4, 41, 2, 201, 18, 9, 1000], pad_to=8))
    assert replay.num_decodes == captured.num_decodes
    assert captured.decode_seq_lens.tolist() == [4, 41, 2, 201, 18, 9, 1000, 0]
    assert captured.decode_slots.tolist() == [7, 8, 9, 10, 11, 12, 13, -1]
    assert captured.block_table[6, 0].item() == 1 + 600 + 1000 and captured.block_table[7].eq(0).all()
    assert replay.decode_seq_lens.data_ptr() == captured.decode_seq_lens.data_ptr()


def test_mixed_metadata_indexes_the_chunks():
    """Two decodes, a chunk after 10 cached tokens, a first prefill: the chunk
    index covers the last two requests' tokens only."""
    builder, buf = _builder(kernels="triton"), RunnerBuffers()
    md = builder.build(0, buf.step([1, 1, 5, 7], [30, 2, 15, 7]))
    assert md.num_decodes == 2 and md.decode_seq_lens.tolist() == [30, 2]
    assert md.decode_slots.tolist() == [7, 8]
    c = md.chunks
    assert c.positions.tolist() == list(range(10, 15)) + list(range(7))
    assert c.request.tolist() == [2] * 5 + [3] * 7
    assert c.seq_end.tolist() == [15] * 5 + [7] * 7
    assert torch.equal(c.extend_tiles, query_tiles([(2, 0, 5, 10), (3, 5, 7, 0)], "cpu"))

    md = builder.build(0, buf.step([3, 1], [3, 9]))  # a chunk first: no decodes
    assert md.num_decodes == 0 and md.decode_seq_lens.numel() == 0
    assert md.chunks.positions.tolist() == [0, 1, 2, 8] and md.chunks.request.tolist() == [0, 0, 0, 1]


def test_reference_path_metadata():
    md = _builder(kernels="reference").build(0, RunnerBuffers().step([1, 4], [9, 4]))
    assert not md.triton and md.chunks is None
    assert md.query_start_loc == [0, 1, 5] and md.seq_lens == [9, 4] and md.num_decodes == 1


@pytest.mark.parametrize("kvq, support", [
    ({"kernels": "triton"}, "UNIFORM_SINGLE_TOKEN_DECODE"),
    ({"kernels": "reference"}, "NEVER"),
    ({"kernels": "auto"}, "NEVER"),  # the reference ops on this CPU
])
def test_cudagraph_support(kvq, support):
    """What OSCAR declares to vLLM: full graphs for decode batches with the
    Triton path, none with the reference ops (they loop over requests on the
    host)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_kvq.backends.oscar import OscarMetadataBuilder

    assert OscarMetadataBuilder.get_cudagraph_support(_config(**kvq), None) == AttentionCGSupport[support]
