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
from collections.abc import Callable, Hashable, Iterable, Sequence

from kvlab.metrics import PrefixCacheStats, blocks_for
from kvlab.sequence import Sequence as Sequence_

NULL_BLOCK = -1  # a block-table entry freed behind a sliding window (vLLM's null_block); never read unmasked


def block_hash(parent: int | None, tokens: list[int], extra: str | None = None) -> int:
    """A full block's identity: SHA-256 of its parent's hash and its token ids, as a 128-bit integer.

    Chaining makes equal hashes mean equal whole prefixes; a cryptographic hash (as vLLM offers) makes a
    collision, which would silently serve another prompt's K and V, practically impossible. `extra` is mixed into
    the first block only (vLLM's extra keys: LoRA, multimodal inputs, `cache_salt`), and the chain carries it to
    every later block, so requests with different salts never share a block.
    """
    digest = hashlib.sha256()
    digest.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    if extra is not None:
        digest.update(b"salt:" + extra.encode())
    digest.update(array.array("q", tokens).tobytes())
    return int.from_bytes(digest.digest()[:16], "little")


def blocks_per_request(
    windows: Sequence[int | None], block_size: int, max_num_batched_tokens: int, context_len: int
) -> int:
    """Most blocks one request of `context_len` tokens holds over all KV-cache groups: a sliding group at most
    cdiv(window - 1 + max_num_batched_tokens, block_size) + 1 (vLLM 0.33.0 `SlidingWindowSpec.
    max_memory_usage_bytes`, `vllm/v1/kv_cache_interface.py`)."""
    return sum(
        blocks_for(context_len, block_size)
        if w is None
        else blocks_for(min(w - 1 + max_num_batched_tokens, context_len), block_size) + 1
        for w in windows
    )


def longest_request(
    windows: Sequence[int | None], num_blocks: int, block_size: int, max_num_batched_tokens: int, limit: int
) -> int:
    """The longest sequence, at most `limit` tokens, that `num_blocks` blocks hold alone (the model's limit if only
    sliding groups hold it); otherwise a whole number of blocks."""

    def fits(tokens: int) -> bool:
        return blocks_per_request(windows, block_size, max_num_batched_tokens, tokens) <= num_blocks

    if fits(limit):
        return limit
    # Bisect on whole blocks: `fits` holds at `low` blocks (or low is 0) and fails at `high`.
    low, high = 0, limit // block_size + 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * block_size) else (low, mid)
    return low * block_size


class BlockAllocator:
    """Reference counts and vLLM v1's free queue.

    The queue's front is handed out first. As in vLLM 0.33.0 (`vllm/v1/core/block_pool.py`
    `BlockPool.free_blocks`, on `FreeKVCacheBlockQueue` of `vllm/v1/core/kv_cache_utils.py`), blocks freed holding no
    cached hash go to the FRONT (reused first, last freed first), and blocks holding a cached prefix go to the
    BACK (evicted last, least recently freed first). Callers free a request's blocks tail first, so its tail is
    evicted before its shared head.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.hashes: list[Hashable | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict: Callable[[int, Hashable], None] = lambda block_id, key: None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def free_order(self) -> list[int]:
        """Free blocks in the order they will be handed out (the last ones are evicted last)."""
        return list(self.free)

    def allocate(self) -> int:
        """The block at the front of the free queue, with ref count 1; evicts its cached contents if any."""
        if not self.free:
            raise MemoryError("no free KV blocks")
        block_id, _ = self.free.popitem(last=False)
        key = self.hashes[block_id]
        if key is not None:
            self.on_evict(block_id, key)
            self.hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def share(self, block_id: int) -> None:
        """One more user of a block; a free (cached) block comes back off the free list."""
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def release_all(self, ordered: Iterable[int]) -> None:
        """Drop one reference to each block, given in eviction order (the first is evicted first)."""
        fresh = []
        for block_id in ordered:
            if self.ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} released more often than taken")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.hashes[block_id] is None:
                    fresh.append(block_id)
                else:
                    self.free[block_id] = None  # at the back: evicted last
        for block_id in reversed(fresh):  # at the front, keeping their order: reused first
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)

    def release(self, block_id: int) -> None:
        self.release_all([block_id])


class BlockManager:
    """Block tables of sequences, on a `BlockAllocator`, with optional prefix caching.

    `windows` lists the KV-cache groups of the model (`kvlab.paging.kv_cache_groups`): `None` for a group of
    full-attention layers, the window for a group of sliding-window layers. Each sequence keeps one block table
    per group (vLLM's hybrid KV cache manager); all groups draw blocks from one allocator. A sliding group frees
    the blocks that fall wholly behind its window before each step (vLLM's `SlidingWindowManager`
    `remove_skipped_blocks`): their table entries become `NULL_BLOCK`, so a sequence holds the window's blocks
    plus the blocks being written, however long it grows.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w is not None and w < 2 for w in windows):
            raise ValueError(f"windows must be None or >= 2, one per KV-cache group, got {list(windows)}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows)
        self.has_sliding_groups = any(w is not None for w in windows)
        self.cached: dict[tuple[int, int], int] = {}  # (group, block hash) -> block id
        self.block_group = [0] * num_blocks  # which group a block in use belongs to
        self.allocator.on_evict = self._evict
        self.prefix_cache_stats = PrefixCacheStats()  # lookups so far, one per request
        self.num_recomputed_tokens = 0  # tokens prefilled again after a preemption (cache hits excluded)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

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

    def num_used_blocks_by_group(self) -> list[int]:
        """Blocks in use, per KV-cache group."""
        counts = [0] * self.num_groups
        for block_id, refs in enumerate(self.allocator.ref_counts):
            if refs:
                counts[self.block_group[block_id]] += 1
        return counts

    def max_concurrency(self, context_len: int, max_num_batched_tokens: int) -> float:
        """How many requests of `context_len` tokens the pool holds at once (vLLM's startup figure)."""
        return self.num_blocks / blocks_per_request(
            self.windows, self.block_size, max_num_batched_tokens, context_len
        )

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the pool can hold alone (full-attention groups keep every token)."""
        return self.num_blocks * self.block_size // self.num_groups

    def _evict(self, block_id: int, key: Hashable) -> None:
        if self.cached.get(key) == block_id:  # type: ignore[call-overload]
            del self.cached[key]  # type: ignore[arg-type]

    def _hashes(self, seq: Sequence_) -> list[int]:
        """Chained hashes of the sequence's full blocks (memoised: a full block's tokens never change)."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            extra = seq.cache_salt if i == 0 else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], extra))
        return seq.block_hashes

    def _skipped_blocks(self, group: int, num_computed_tokens: int) -> int:
        """Leading blocks no query from `num_computed_tokens` on attends (vLLM's `get_num_skipped_tokens`)."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def _group_hit(self, group: int, hashes: list[int], limit: int) -> int:
        """Longest prefix, at most `limit` blocks, this group can serve from cache.

        A full-attention group needs every block of the prefix; a sliding group only the blocks its window still
        reads at the first uncomputed token (vLLM's `SlidingWindowManager.find_longest_cache_hit`).
        """
        cached = self.cached
        if self.windows[group] is None:
            n = 0
            while n < limit and (group, hashes[n]) in cached:
                n += 1
            return n
        for n in range(limit, 0, -1):
            first = self._skipped_blocks(group, n * self.block_size)
            if all((group, hashes[i]) in cached for i in range(first, n)):
                return n
        return 0

    def cached_prefix(self, seq: Sequence_) -> list[int]:
        """Cached blocks covering the longest prefix of `seq`, leaving at least one token to compute (the first
        KV-cache group's table; `cached_tables` gives every group's)."""
        return self.cached_tables(seq)[0]

    def cached_tables(self, seq: Sequence_) -> list[list[int]]:
        """Per group, the table of cached blocks covering the longest prefix of `seq` every group can serve,
        leaving at least one token to compute (`NULL_BLOCK` where a sliding group no longer needs a block)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.windows]
        hashes = self._hashes(seq)
        n = (seq.num_tokens - 1) // self.block_size
        while True:  # every group must serve the same prefix; shrink until they all do
            shorter = min(self._group_hit(g, hashes, n) for g in range(self.num_groups))
            if shorter == n:
                break
            n = shorter
        tables = []
        for g in range(self.num_groups):
            first = self._skipped_blocks(g, n * self.block_size)
            tables.append([NULL_BLOCK] * first + [self.cached[(g, h)] for h in hashes[first:n]])
        return tables

    def _new_blocks_needed(self, seq: Sequence_, num_new_tokens: int) -> int:
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return sum(max(0, total - len(table)) for table in seq.block_tables)

    def can_fit_alone(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) * self.num_groups <= self.num_blocks

    def allocate(self, seq: Sequence_, num_new_tokens: int, reserve_tokens: int = 0) -> int | None:
        """Admit a sequence holding no blocks: take its cached prefix, then blocks for up to `num_new_tokens`
        more. Returns how many tokens it will compute (the hit shortens the work), or None if the pool is short.

        `reserve_tokens`: admit only if blocks for that many tokens in all (the whole prompt: vLLM's
        `scheduler_reserve_full_isl`) would be free, though only the first chunk's blocks are taken now.
        """
        assert not any(seq.block_tables), "allocate is for sequences without blocks"
        tables = self.cached_tables(seq)
        cached = (len(tables[0])) * self.block_size
        num_new_tokens = min(num_new_tokens, seq.num_tokens - cached)
        hits = {b for table in tables for b in table if b != NULL_BLOCK}
        revived = sum(
            self.allocator.ref_counts[b] == 0 for b in hits
        )  # cached but free: they leave the free list
        target = max(cached + num_new_tokens, min(reserve_tokens, seq.num_tokens))
        fresh = sum(blocks_for(target, self.block_size) - len(table) for table in tables)
        if revived + fresh > self.num_free_blocks:
            return None
        for table in tables:
            for block_id in table:
                if block_id != NULL_BLOCK:
                    self.allocator.share(block_id)
        seq.block_tables = tables
        if seq.metrics.num_preemptions:
            self.num_recomputed_tokens += seq.num_tokens - 1 - cached  # all but the last are recomputed
        seq.num_computed_tokens = cached
        # Hit statistics count each request once, at its first admission: a request re-admitted after
        # preemption finds its own blocks again, which is recomputation saved, not prefix sharing.
        if self.enable_prefix_caching and seq.metrics.num_preemptions == 0:
            self.prefix_cache_stats = self.prefix_cache_stats.record(seq.num_tokens, cached)
        self.append_slots(seq, num_new_tokens)
        return num_new_tokens

    def remove_skipped_blocks(self, seq: Sequence_) -> None:
        """Free the blocks of sliding groups that lie wholly behind the window of the next token to compute."""
        if not self.has_sliding_groups:
            return
        for g, table in enumerate(seq.block_tables):
            skipped = min(self._skipped_blocks(g, seq.num_computed_tokens), len(table))
            freed = []
            for i in range(skipped - 1, -1, -1):  # last first, as vLLM does; stop at what is already null
                if table[i] == NULL_BLOCK:
                    break
                freed.append(table[i])
                table[i] = NULL_BLOCK
            self.allocator.release_all(freed)

    def append_slots(self, seq: Sequence_, num_new_tokens: int) -> bool:
        """Blocks for the next `num_new_tokens` tokens of a running sequence; all or nothing."""
        self.remove_skipped_blocks(seq)
        needed = self._new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        for g, table in enumerate(seq.block_tables):
            for _ in range(total - len(table)):
                block_id = self.allocator.allocate()
                self.block_group[block_id] = g
                table.append(block_id)
        self._cache_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def _cache_full_blocks(self, seq: Sequence_, num_tokens: int) -> None:
        """Publish the blocks that `num_tokens` tokens fill, so other requests can share them.

        As in vLLM, this happens when the tokens are scheduled, not after they are computed: a request admitted
        later in the same step can already share them, because each layer writes the whole step's K/V to the pool
        before any sequence attends.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(seq)
        hashes_of = self.allocator.hashes
        for g, table in enumerate(seq.block_tables):
            for i in range(num_tokens // self.block_size):
                block_id = table[i]
                if block_id == NULL_BLOCK or hashes_of[block_id] is not None:
                    continue
                key = (g, hashes[i])
                if key not in self.cached:
                    hashes_of[block_id] = key
                    self.cached[key] = block_id

    def free(self, seq: Sequence_) -> None:
        """Give back a sequence's blocks, group by group, last block first, so its tail is evicted before its
        shared head (vLLM's `SingleTypeKVCacheManager.free`)."""
        for table in seq.block_tables:
            self.allocator.release_all(b for b in reversed(table) if b != NULL_BLOCK)
        seq.block_tables = [[] for _ in self.windows]
        seq.num_computed_tokens = 0

    def used_token_slots(self, seqs: Iterable[Sequence_]) -> int:
        """Token slots of the pool that hold a computed token (a shared block counts once)."""
        bs = self.block_size
        if not self.enable_prefix_caching and not self.has_sliding_groups:
            # No block is shared and no entry is null: each table's computed tokens fill its blocks in order.
            return sum(min(seq.num_computed_tokens, len(t) * bs) for seq in seqs for t in seq.block_tables)
        filled: dict[int, int] = {}
        for seq in seqs:
            for table in seq.block_tables:
                for i, block_id in enumerate(table):
                    if block_id != NULL_BLOCK:
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

    def allocate(self, seq: Sequence_, num_new_tokens: int, reserve_tokens: int = 0) -> int | None:
        assert not seq.block_table, "allocate is for sequences without blocks"
        start = self._first_fit()
        if start is None:
            return None
        for block_id in range(start, start + self.reserve_blocks):
            self.allocator.share(block_id)
        seq.block_table = list(range(start, start + self.reserve_blocks))
        return min(num_new_tokens, seq.num_tokens)

    def append_slots(self, seq: Sequence_, num_new_tokens: int) -> bool:
        # Everything up to max_model_len was reserved at admission.
        return self._new_blocks_needed(seq, num_new_tokens) == 0
