"""Window checkpoints: copies of a request's R state blocks (sink and window
rows) taken when its computed length is a block boundary ``b``, cached under
keys derived from the hash of data block ``b / KB - 1``, one key per state
block, so a partly evicted checkpoint is not found (docs/design.md, "Prefix
caching"). Here: the keys and each pool's demand record; ``kv_spec.py``
decides when to take, restore and drop them.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict

from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

_TAG = b"vllm-kvq/oscar-window-checkpoint"
_DEMAND_ENTRIES = 4096  # boundaries remembered per pool (oldest forgotten first)


def checkpoint_key(boundary: BlockHash, index: int, group_id: int):
    """Pool key of state block ``index`` of the checkpoint at ``boundary``
    (the hash of the last data block before it); never a data block's key."""
    digest = hashlib.sha256(_TAG + bytes(boundary) + index.to_bytes(4, "little")).digest()
    return make_block_hash_with_group_id(BlockHash(digest), group_id)


def _cached(block_pool, boundary: BlockHash, num_blocks: int, group_id: int) -> list:
    """The checkpoint's cached blocks in state-block order (None where evicted)."""
    cache = block_pool.cached_block_hash_to_block
    return [cache.get_one_block(checkpoint_key(boundary, i, group_id)) for i in range(num_blocks)]


def find(block_pool, boundary: BlockHash, num_blocks: int, group_id: int):
    """The checkpoint's blocks in state-block order, or None unless all are cached."""
    blocks = _cached(block_pool, boundary, num_blocks, group_id)
    return None if any(block is None for block in blocks) else blocks


def register(block_pool, boundary: BlockHash, blocks, group_id: int) -> None:
    for i, block in enumerate(blocks):
        block_pool._insert_block_hash(checkpoint_key(boundary, i, group_id), block, num_tokens=None)


def drop(block_pool, boundary: BlockHash, num_blocks: int, group_id: int) -> None:
    """Forget a checkpoint whose blocks nobody holds and put them at the head
    of the free queue, to be reused first: left where they were (the tail, as
    recently cached blocks) the next checkpoints would draw fresh blocks and
    push older cached blocks out."""
    released = [b for b in _cached(block_pool, boundary, num_blocks, group_id) if b is not None and b.ref_cnt == 0]
    for block in released:
        block_pool._maybe_evict_cached_block(block)
        block_pool.free_block_queue.remove(block)
    block_pool.free_block_queue.prepend_n(released)


class Demand:
    """Boundaries that lookups asked for. A request keeps only its newest
    checkpoint unless an older one was hit, or a lookup found data blocks up
    to that boundary without a checkpoint there (a shared-prefix junction)."""

    def __init__(self) -> None:
        self._asked: OrderedDict[BlockHash, None] = OrderedDict()

    def ask(self, boundary: BlockHash) -> None:
        self._asked[boundary] = None
        self._asked.move_to_end(boundary)
        while len(self._asked) > _DEMAND_ENTRIES:
            self._asked.popitem(last=False)

    def asked(self, boundary: BlockHash) -> bool:
        return boundary in self._asked


_DEMAND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def demand(block_pool) -> Demand:
    """The demand record of one block pool (shared by its OSCAR groups)."""
    return _DEMAND.setdefault(block_pool, Demand())
