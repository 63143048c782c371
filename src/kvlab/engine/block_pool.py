"""The block pool: every KV block's reference count, the free queue, and the prefix cache's hash index.

A full block is known by a hash of its tokens chained with its parent block's hash, so equal hashes mean equal
whole prefixes (Kwon et al., 2023, arXiv:2309.06180; vLLM's automatic prefix caching). The pool keeps, for each
block, the key it is cached under, and for each key every block that holds it, first cached first. A block
whose last user leaves keeps its key and waits on the free queue; a later request with the same prefix takes it
back, and only when a fresh block is needed is the front of the queue evicted, and counted.

This is vLLM v1's `BlockPool` on plain integers instead of block objects.
Chapters 7 and 9.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Iterable

# A block-table entry freed behind a sliding window (vLLM's null_block); never read unmasked
NULL_BLOCK = -1

# (KV-cache group, block hash): groups cache their blocks apart (vLLM's BlockHashWithGroupId)
BlockKey = tuple[int, int]


def hash_block_tokens(parent: int | None, tokens: list[int], extra: str | None = None) -> int:
    """A full block's identity: SHA-256 of its parent's hash and its token ids, as a 128-bit integer.

    A cryptographic hash makes a collision, which would serve another prompt's K and V, practically impossible.
    `extra` (a request's `cache_salt`) is mixed into the first block only, and the chain carries it on, so
    requests with different salts never share a block.
    """
    digest = hashlib.sha256()
    digest.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    if extra is not None:
        digest.update(b"salt:" + extra.encode())
    digest.update(array.array("q", tokens).tobytes())
    return int.from_bytes(digest.digest()[:16], "little")


class BlockPool:
    """`num_blocks` blocks: reference counts, the free queue in eviction order, and the hash index.

    The queue's front is handed out first. Blocks freed holding no cached key go to the FRONT (reused first, the
    last freed first); blocks holding one go to the BACK (evicted last, the least recently freed first). Callers
    free a request's blocks tail first, so its tail is evicted before its shared head.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # The key each block is cached under (None: not cached)
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Key -> every block holding it, first cached first: duplicates are kept, so block tables only grow
        self.cached_block_hash_to_block: dict[BlockKey, dict[int, None]] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached key, in use or free but not yet evicted (duplicates counted)."""
        return sum(len(blocks) for blocks in self.cached_block_hash_to_block.values())

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Blocks from the front of the free queue, each with reference count 1; their cached keys are evicted."""
        if num_blocks > len(self.free_block_queue):
            raise MemoryError(f"{num_blocks} KV blocks asked, {len(self.free_block_queue)} free")
        popitem, hashes, ref_cnt = self.free_block_queue.popitem, self.block_keys, self.ref_cnt
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = popitem(last=False)
            if hashes[block_id] is not None:
                self._evict(block_id)
            ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def _evict(self, block_id: int) -> None:
        """Forget one block's copy of its key; another copy of the same key stays cached."""
        key = self.block_keys[block_id]
        assert key is not None
        self.block_keys[block_id] = None
        blocks = self.cached_block_hash_to_block[key]
        del blocks[block_id]
        if not blocks:
            del self.cached_block_hash_to_block[key]
        self.num_evictions += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more user of each block (a prefix-cache hit); a free one leaves the free queue."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_block_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free_blocks(self, ordered: Iterable[int]) -> None:
        """Drop one reference to each block, given in eviction order (the first is evicted first)."""
        fresh = []
        for block_id in ordered:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"block {block_id} released more often than taken")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                if self.block_keys[block_id] is None:
                    fresh.append(block_id)
                else:
                    # At the back: evicted last
                    self.free_block_queue[block_id] = None
        # At the front, keeping their order: reused first
        for block_id in reversed(fresh):
            self.free_block_queue[block_id] = None
            self.free_block_queue.move_to_end(block_id, last=False)

    def cache_full_block(self, block_id: int, key: BlockKey) -> None:
        """Publish a full block under `key`, beside any block already holding it."""
        self.block_keys[block_id] = key
        self.cached_block_hash_to_block.setdefault(key, {})[block_id] = None
