"""How OSCAR pages are declared to vLLM's allocator: each request owns ``R``
state blocks (its BF16 sink and window) in front of its data blocks, all from
the one block pool, and the spec counts them (memory, block-table width,
capacity report). With prefix caching the manager hashes only data blocks and
restores a hit's state blocks from a window checkpoint (docs/design.md,
"Prefix caching").
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, get_block_hash, resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_kvq.backends import window_checkpoints as checkpoints


@dataclass(frozen=True, kw_only=True)
class OscarAttentionSpec(FullAttentionSpec):
    """A full-attention spec whose requests also hold ``state_blocks`` blocks."""

    state_blocks: int = 0

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, **changes) -> "OscarAttentionSpec":
        values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
        values.update(changes)
        return cls(**values)

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
    """Full-attention allocation plus ``state_blocks`` leading blocks per
    request (asking for that many more token slots makes the first allocation
    hand them out first), and prefix caching of the data blocks behind them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = self.kv_cache_spec.state_blocks
        self._restores: dict[str, list[KVCacheBlock]] = {}  # checkpoint to copy into new state blocks
        self._newest: dict[str, tuple[BlockHash, int]] = {}  # each request's newest checkpoint and its position
        self._junction: dict[str, int] = {}  # where cached data blocks ran past a request's usable hit
        self._taken: list[tuple[BlockHash, list[KVCacheBlock], BlockHash | None]] = []  # copies queued this step
        self._restored_from: dict[str, BlockHash] = {}  # the checkpoint each running request was restored from
        self._held: dict[BlockHash, list[KVCacheBlock]] = {}  # checkpoints pinned while shared

    def _extra_tokens(self) -> int:
        return self._state * self.block_size

    def _hashes(self, block_hashes):
        return resolve_block_hashes(block_hashes, self.block_pool.hash_block_size, self.block_size)

    def _checkpoint(self, boundary: BlockHash):
        return checkpoints.find(self.block_pool, boundary, self._state, self.kv_cache_group_id)

    # ---------------------------------------------------------------- lookup
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        hit, length = super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
            kv_cache_spec.block_size, dcp_world_size, pcp_world_size,
        )
        block_size = kv_cache_spec.block_size * dcp_world_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        full = length // block_size
        step = alignment_tokens if alignment_tokens % block_size == 0 else block_size  # hybrids: the groups' LCM
        usable = full
        while usable and ((usable * block_size) % step or not all(
            checkpoints.find(block_pool, hashes[usable - 1], kv_cache_spec.state_blocks, g) is not None
            for g in kv_cache_group_ids
        )):
            usable -= 1
        if usable < full:  # data blocks without a checkpoint: the next request through here keeps one
            checkpoints.demand(block_pool).ask(hashes[full - 1])
        return tuple(blocks[:usable] for blocks in hit), usable * block_size

    # ------------------------------------------------------------ allocation
    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, *args, **kwargs):
        extra = self._extra_tokens()
        blocks = super().get_num_blocks_to_allocate(
            request_id, num_tokens + extra, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model + extra, *args, **kwargs,
        )
        if new_computed_blocks and request_id not in self.num_cached_block:
            blocks += self._get_num_evictable_blocks(
                self._checkpoint(get_block_hash(new_computed_blocks[-1].block_hash)) or ())
        return blocks

    def add_local_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                  num_external_computed_tokens) -> None:
        super().add_local_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens,
                                          num_external_computed_tokens)
        if not new_computed_blocks:
            return
        boundary = get_block_hash(new_computed_blocks[-1].block_hash)
        checkpoint = self._checkpoint(boundary)
        if checkpoint is None:
            raise RuntimeError("OSCAR prefix hit without its window checkpoint (found by the lookup)")
        self.block_pool.touch(checkpoint)  # held until the copy has run (the CoW retention)
        self._restores[request_id] = checkpoint
        self._newest[request_id] = (boundary, num_local_computed_tokens)
        checkpoints.demand(self.block_pool).ask(boundary)  # hit once: worth keeping
        self._restored_from[request_id] = boundary
        if boundary not in self._held and list(self._restored_from.values()).count(boundary) > 1:
            # Several running requests share this prefix: keep its checkpoint
            # out of eviction while they run, so that more requests through it
            # (and preempted ones coming back) still hit.
            self.block_pool.touch(checkpoint)
            self._held[boundary] = checkpoint

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        extra = self._extra_tokens()
        checkpoint = self._restores.pop(request_id, None)
        restored = []
        if checkpoint is not None:
            # The hit's data blocks are in place; its state blocks go in front
            # of them and get the checkpoint's rows before the first forward.
            restored = self.block_pool.get_new_blocks(self._state)
            self.req_to_blocks[request_id][0:0] = restored
            self._copy(checkpoint, restored, retain_source=False)
        return restored + super().allocate_new_blocks(request_id, num_tokens + extra, num_tokens_main_model + extra)

    def _copy(self, sources, targets, retain_source: bool) -> None:
        """Queue block copies that vLLM's worker runs before this step's
        forward; both ends are held until then (vLLM releases one reference
        of each after the step)."""
        for src, dst in zip(sources, targets):
            if retain_source:
                src.ref_cnt += 1
            dst.ref_cnt += 1
            self._pending_cow_copies.append((src, dst))

    # --------------------------------------------------------------- caching
    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries) -> None:
        """Hash the full data blocks (never the state blocks), then take a
        window checkpoint if this step starts on a block boundary."""
        req_id = request.request_id
        cached = self.num_cached_block.get(req_id, 0)
        if req_id not in self._junction:
            self._junction[req_id] = self._cached_run(request, cached) * self.block_size
        full = num_tokens // self.block_size
        if full > cached:
            self.block_pool.cache_full_blocks(
                request=request, blocks=self.req_to_blocks[req_id][self._state:], num_cached_blocks=cached,
                num_full_blocks=full, block_size=self.block_size, kv_cache_group_id=self.kv_cache_group_id,
            )
            self.num_cached_block[req_id] = full
        self._maybe_checkpoint(request)

    def _cached_run(self, request, start: int) -> int:
        """How far other requests' cached data blocks cover this request's
        tokens from block ``start`` on (before it caches its own)."""
        hashes = self._hashes(request.block_hashes)
        end = start
        while end < len(hashes) and self.block_pool.get_cached_block(hashes[end], [self.kv_cache_group_id]):
            end += 1
        return end if end > start else 0

    def _maybe_checkpoint(self, request) -> None:
        """At the start of a step whose request has computed exactly ``b``
        tokens (a block multiple), its state blocks hold the sink and the
        rows of ``b - W .. b``: copy them into R fresh blocks, cached (and
        evictable) from the next step on. Best effort: skipped when the pool
        is short, and only steps that start on a block boundary take one."""
        computed = request.num_computed_tokens
        if computed == 0 or computed % self.block_size or computed > request.num_tokens:
            return
        hashes = self._hashes(request.block_hashes)
        if len(hashes) < computed // self.block_size:
            return
        boundary = hashes[computed // self.block_size - 1]
        req_id = request.request_id
        previous = self._newest.get(req_id)
        if previous is not None and previous[0] == boundary:
            return
        if self._checkpoint(boundary) is not None:
            self._newest[req_id] = (boundary, computed)
            return
        if self.block_pool.get_num_free_blocks() < self._state + len(self.req_to_blocks):
            return  # leave a block for each request this step may grow
        copies = self.block_pool.get_new_blocks(self._state)
        self._copy(self.req_to_blocks[req_id][: self._state], copies, retain_source=True)
        self._newest[req_id] = (boundary, computed)
        stale = previous is not None and not self._keeps(request, previous[1], computed)
        self._taken.append((boundary, copies, previous[0] if stale else None))

    def _keeps(self, request, position: int, computed: int) -> bool:
        """Whether a request moving its newest checkpoint from ``position`` to
        ``computed`` keeps the older one: the last one before where other
        requests' blocks and its own diverged (the next request sharing that
        prefix hits there), and the last one inside the prompt (a resent
        prompt hits there)."""
        junction = self._junction.get(request.request_id, 0)
        resend = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        return position <= junction < computed or position <= resend < computed

    def new_step_starts(self) -> None:
        """Last step's checkpoints have been copied: cache them, release them
        to the evictable part of the pool, and forget each request's previous
        checkpoint unless it is kept or a lookup asked for it."""
        super().new_step_starts()
        taken, self._taken = self._taken, []
        demand = checkpoints.demand(self.block_pool)
        for boundary, blocks, stale in taken:
            checkpoints.register(self.block_pool, boundary, blocks, self.kv_cache_group_id)
            self.block_pool.free_blocks(blocks)
            if stale is not None and not demand.asked(stale):
                checkpoints.drop(self.block_pool, stale, self._state, self.kv_cache_group_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        for bookkeeping in (self._newest, self._restores, self._junction):
            bookkeeping.pop(request_id, None)
        boundary = self._restored_from.pop(request_id, None)
        if boundary in self._held and boundary not in self._restored_from.values():  # its last sharer is done
            self.block_pool.free_blocks(self._held.pop(boundary))
        return super().pop_blocks_for_free(request_id)
