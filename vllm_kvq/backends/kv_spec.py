"""How OSCAR pages are declared to vLLM's allocator.

Each request owns ``R`` state blocks (its BF16 sink and window) in front of
its INT2 data blocks, all drawn from the one block pool. The spec tells vLLM
about those blocks (memory accounting, block-table width, capacity report) and
the manager reserves them when the request gets its first blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec


@dataclass(frozen=True, kw_only=True)
class OscarAttentionSpec(FullAttentionSpec):
    """A full-attention spec whose requests also hold ``state_blocks`` blocks."""

    state_blocks: int = 0

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, **changes) -> "OscarAttentionSpec":
        values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
        values.update(changes)
        return cls(**values)

    @property
    def prefix_cacheable(self) -> bool:
        # A prefix hit would share INT2 pages but not the requester's BF16
        # sink/window rows, which live in per-request state blocks.
        return False

    def max_memory_usage_bytes(self, vllm_config) -> int:
        return super().max_memory_usage_bytes(vllm_config) + self.state_blocks * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return super().max_num_blocks_per_req(vllm_config, max_len) + self.state_blocks

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)
        state_blocks = {s.state_blocks for s in specs}
        if len(state_blocks) != 1:
            raise AssertionError("All OSCAR layers of a group must share one page format.")
        return replace(merged, state_blocks=state_blocks.pop())


class OscarKVCacheManager(FullAttentionManager):
    """Full-attention allocation plus ``state_blocks`` leading blocks per request.

    Asking for ``state_blocks * block_size`` more token slots than the request
    has makes the first allocation hand out the state blocks first; they stay
    at the head of the block table until the request is freed or preempted.
    """

    def _extra_tokens(self) -> int:
        return self.kv_cache_spec.state_blocks * self.block_size

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, *args, **kwargs):
        extra = self._extra_tokens()
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens + extra, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model + extra, *args, **kwargs,
        )

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        extra = self._extra_tokens()
        return super().allocate_new_blocks(request_id, num_tokens + extra, num_tokens_main_model + extra)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args, **kwargs):
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, *args, **kwargs) -> None:
        return
