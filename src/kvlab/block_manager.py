"""Which blocks of the pool each sequence owns: the allocator, prefix caching, and the contiguous baseline.

`BlockAllocator` keeps a reference count per block and a free list in eviction order. `BlockManager` gives each
sequence a block table and, with prefix caching, shares full blocks between sequences the way vLLM does
(Kwon et al., 2023, arXiv:2309.06180, and vLLM's automatic prefix caching): a full block is identified by a hash
of its tokens chained with its parent block's hash, so equal hashes mean equal whole prefixes. A block whose last
user finishes keeps its hash and stays on the free list; a later request with the same prefix takes it back, and
only when the allocator needs a fresh block is the least recently freed one evicted.

`ContiguousBlockManager` is what servers did before paging: reserve `max_model_len` tokens of contiguous memory
per request at admission. On the same pool and trace, it shows how much reserved memory holds no token.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Iterable

from kvlab.metrics import PrefixCacheStats, blocks_for
from kvlab.sequence import Sequence


def block_hash(parent: int | None, tokens: list[int]) -> int:
    """A full block's identity: SHA-256 of its parent's hash and its token ids, as a 128-bit integer.

    Chaining makes equal hashes mean equal whole prefixes; a cryptographic hash (as vLLM offers) makes a
    collision, which would silently serve another prompt's K and V, practically impossible.
    """
    digest = hashlib.sha256()
    digest.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    digest.update(array.array("q", tokens).tobytes())
    return int.from_bytes(digest.digest()[:16], "little")


class BlockAllocator:
    """Reference counts and a free list; free blocks leave in least-recently-freed order."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict = lambda block_id, block_hash: None  # the prefix cache forgets an evicted hash

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        """A fresh block with ref count 1; evicts the oldest free block's cached contents."""
        if not self.free:
            raise MemoryError("no free KV blocks")
        block_id, _ = self.free.popitem(last=False)
        if self.hashes[block_id] is not None:
            self.on_evict(block_id, self.hashes[block_id])
            self.hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def share(self, block_id: int) -> None:
        """One more user of a block; a free (cached) block comes back off the free list."""
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} released more often than taken")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None  # at the tail: evicted last


class BlockManager:
    """Block tables of sequences, on a `BlockAllocator`, with optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.allocator.on_evict = self._evict
        self.prefix_cache_stats = PrefixCacheStats()  # lookups so far, one per request

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a published prefix, in use or free but not yet evicted."""
        return len(self.cached)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the pool can hold alone."""
        return self.num_blocks * self.block_size

    def _evict(self, block_id: int, block_hash: int) -> None:
        if self.cached.get(block_hash) == block_id:
            del self.cached[block_hash]

    def _hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of the sequence's full blocks (memoised: a full block's tokens never change)."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return seq.block_hashes

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering the longest prefix of `seq`, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for block_hash in self._hashes(seq)[: (seq.num_tokens - 1) // self.block_size]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, blocks_for(total, self.block_size) - len(seq.block_table))

    def can_fit_alone(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.num_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Admit a sequence holding no blocks: take its cached prefix, then blocks for up to `num_new_tokens`
        more. Returns how many tokens it will compute (the hit shortens the work), or None if the pool is short."""
        assert not seq.block_table, "allocate is for sequences without blocks"
        hits = self.cached_prefix(seq)
        cached = len(hits) * self.block_size
        num_new_tokens = min(num_new_tokens, seq.num_tokens - cached)
        revived = sum(
            self.allocator.ref_counts[b] == 0 for b in hits
        )  # cached but free: they leave the free list
        fresh = blocks_for(cached + num_new_tokens, self.block_size) - len(hits)
        if revived + fresh > self.num_free_blocks:
            return None
        for block_id in hits:
            self.allocator.share(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = cached
        # Hit statistics count each request once, at its first admission: a request re-admitted after
        # preemption finds its own blocks again, which is recomputation saved, not prefix sharing.
        if self.enable_prefix_caching and seq.metrics.num_preemptions == 0:
            self.prefix_cache_stats = self.prefix_cache_stats.record(seq.num_tokens, cached)
        self.append_slots(seq, num_new_tokens)
        return num_new_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for the next `num_new_tokens` tokens of a running sequence; all or nothing."""
        needed = self._new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self.allocator.allocate() for _ in range(needed))
        self._cache_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the blocks that `num_tokens` tokens fill, so other requests can share them.

        As in vLLM, this happens when the tokens are scheduled, not after they are computed: a request admitted
        later in the same step can already share them, because each layer writes the whole step's K/V to the pool
        before any sequence attends.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(seq)
        for i in range(num_tokens // self.block_size):
            block_id = seq.block_table[i]
            if self.allocator.hashes[block_id] is None and hashes[i] not in self.cached:
                self.allocator.hashes[block_id] = hashes[i]
                self.cached[hashes[i]] = block_id

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, last block first, so its tail is evicted before its shared head."""
        for block_id in reversed(seq.block_table):
            self.allocator.release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def used_token_slots(self, seqs: Iterable[Sequence]) -> int:
        """Token slots of the pool that hold a computed token (a shared block counts once)."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for seq in seqs:
            for i, block_id in enumerate(seq.block_table):
                n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), n)
        return sum(filled.values())


class ContiguousBlockManager(BlockManager):
    """Pre-paging allocation: each request reserves one contiguous run of blocks for `max_model_len` tokens.

    The run is found first-fit among free blocks, so fragmentation between runs is real too. No sharing.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.reserve_blocks = blocks_for(max_model_len, block_size)
        if self.reserve_blocks > num_blocks:
            raise ValueError(
                f"max_model_len={max_model_len} does not fit in {num_blocks} blocks of {block_size}"
            )

    def _first_fit(self) -> int | None:
        run = 0
        for block_id, refs in enumerate(self.allocator.ref_counts):
            run = run + 1 if refs == 0 else 0
            if run == self.reserve_blocks:
                return block_id - run + 1
        return None

    def allocate(self, seq: Sequence, num_new_tokens: int) -> int | None:
        assert not seq.block_table, "allocate is for sequences without blocks"
        start = self._first_fit()
        if start is None:
            return None
        for block_id in range(start, start + self.reserve_blocks):
            self.allocator.share(block_id)
        seq.block_table = list(range(start, start + self.reserve_blocks))
        return min(num_new_tokens, seq.num_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        # Everything up to max_model_len was reserved at admission.
        return self._new_blocks_needed(seq, num_new_tokens) == 0
