"""The KV-cache manager: which blocks of the pool each request holds, and what its prefix cache serves.

`BlockManager` answers the scheduler's two questions, as vLLM v1's `KVCacheManager` does. `get_computed_blocks`
returns the longest cached prefix of a waiting request. `allocate_slots` gives a request blocks for its next
tokens, all or nothing, and publishes the blocks those tokens fill. It keeps no request progress: the scheduler
owns `num_computed_tokens` and tells the manager where a request stands.

Under it, one `SingleTypeKVCacheManager` per KV-cache group (full attention or a sliding window) keeps that group's
block tables, all on one `BlockPool`. A hybrid model's hit is the longest prefix every group can serve (vLLM's
`HybridKVCacheCoordinator`). `ContiguousBlockManager` is the baseline from before paging: each request reserves
`max_model_len` tokens of contiguous blocks at admission. Chapters 6, 7 and 9.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvlab.engine.block_pool import NULL_BLOCK, BlockPool
from kvlab.engine.config import check_retention_interval
from kvlab.engine.metrics import PrefixCacheStats
from kvlab.engine.request import Request
from kvlab.engine.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    max_admission_blocks,
)
from kvlab.units import cdiv

__all__ = ["NULL_BLOCK", "BlockManager", "ComputedBlocks", "ContiguousBlockManager", "longest_request"]


def blocks_per_request(
    windows: Sequence[int | None], block_size: int, max_num_batched_tokens: int, context_len: int
) -> int:
    """Most blocks one request of `context_len` tokens holds over all KV-cache groups (`windows`: None for full
    attention), a sliding group at most `max_admission_blocks` (vLLM's `max_memory_usage_bytes`)."""
    return sum(
        cdiv(context_len, block_size)
        if w is None
        else max_admission_blocks(w, block_size, max_num_batched_tokens, context_len)
        for w in windows
    )


def longest_request(
    windows: Sequence[int | None], num_blocks: int, block_size: int, max_num_batched_tokens: int, limit: int
) -> int:
    """The longest request, at most `limit` tokens, that `num_blocks` blocks hold alone (the model's limit if only
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


@dataclass(frozen=True)
class ComputedBlocks:
    """A waiting request's prefix-cache hit: per group, the block table of the cached prefix (`NULL_BLOCK` where
    a sliding group no longer reads a block), the tokens it covers, and the shared-prefix junction it found."""

    blocks: list[list[int]]
    num_computed_tokens: int
    shared_prefix_boundary: int = 0


class BlockManager:
    """Block tables of requests, one group manager per KV-cache group, with optional prefix caching.

    `windows` lists the model's KV-cache groups (`kvlab.engine.kv_pool.kv_cache_groups`): None for full attention,
    the window for sliding-window attention. `prefix_cache_retention_interval` is vLLM's knob for sliding groups.
    `max_in_flight_tokens` (the engine's `max_num_batched_tokens`) and `max_model_len` set a sliding group's
    admission cap; with neither, a whole-prompt reservation counts every prompt block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        windows: Sequence[int | None] = (None,),
        prefix_cache_retention_interval: int | None = 0,
        max_in_flight_tokens: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w is not None and w < 2 for w in windows):
            raise ValueError(f"windows must be None or >= 2, one per KV-cache group, got {list(windows)}")
        self.has_sliding_groups = any(w is not None for w in windows)
        check_retention_interval(prefix_cache_retention_interval, block_size)
        if prefix_cache_retention_interval and not self.has_sliding_groups:
            raise ValueError(
                f"prefix_cache_retention_interval={prefix_cache_retention_interval} has no effect without a"
                " sliding-window KV-cache group; leave it 0"
            )
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows)
        # With no other bound, the tokens in flight are at most max_model_len (as vLLM's KVCacheManager takes them)
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        self.managers: list[SingleTypeKVCacheManager] = [
            FullAttentionManager(g, self.block_pool, block_size, enable_prefix_caching)
            if w is None
            else SlidingWindowManager(
                g,
                self.block_pool,
                block_size,
                enable_prefix_caching,
                w,
                prefix_cache_retention_interval,
                in_flight,
                max_model_len,
            )
            for g, w in enumerate(windows)
        ]
        self.prefix_cache_stats = PrefixCacheStats()  # lookups so far, one per request
        self.num_recomputed_tokens = 0  # tokens prefilled again after a preemption (cache hits excluded)

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.block_pool.num_cached_blocks

    @property
    def capacity_tokens(self) -> int:
        """The longest request the pool can hold alone (full-attention groups keep every token)."""
        return self.num_blocks * self.block_size // self.num_groups

    def max_concurrency(self, context_len: int, max_num_batched_tokens: int) -> float:
        """How many requests of `context_len` tokens the pool holds at once (vLLM's startup figure)."""
        return self.num_blocks / blocks_per_request(
            self.windows, self.block_size, max_num_batched_tokens, context_len
        )

    def get_block_ids(self, request_id: str | None) -> list[list[int]]:
        """The request's block tables, one per group (the managers' own lists; empty while it holds none)."""
        assert request_id is not None
        return [m.req_to_blocks.get(request_id, []) for m in self.managers]

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest prefix of `request` every group serves from cache, leaving at least one token to compute.

        Each group in turn (full attention first) may shorten the candidate, until none does. Where the first
        group alone would hit further, its hit ends on a shared prefix that a sliding group has not kept: that
        junction is the `shared_prefix_boundary`, where the request keeps its window for the next one.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks([[] for _ in self.managers], 0)
        hashes = request.update_block_hashes(self.block_size)
        n = (request.num_tokens - 1) // self.block_size
        longest = None
        while True:
            start = n
            for manager in self.managers:
                n = manager.find_longest_cache_hit(hashes, n)
                longest = n if longest is None else longest
            if n == start:
                break
        boundary = longest * self.block_size if longest and longest > n else 0
        blocks = [m.hit_blocks(hashes, n) for m in self.managers]
        return ComputedBlocks(blocks, n * self.block_size, boundary)

    def get_num_blocks_to_admit(self, hit: ComputedBlocks, num_tokens: int, reserve_tokens: int = 0) -> int:
        """Free blocks needed to admit a request with this hit and `num_tokens` tokens computed after the step:
        the hit's blocks that sit free (cached, unused), then the blocks its tables lack. With `reserve_tokens`
        (the whole prompt: vLLM's `scheduler_reserve_full_isl`), blocks for that many tokens must be free too,
        each sliding group counted at most at its admission cap."""
        ref_cnt = self.block_pool.ref_cnt
        revived = len({b for table in hit.blocks for b in table if b != NULL_BLOCK and ref_cnt[b] == 0})
        pairs = list(zip(self.managers, hit.blocks, strict=True))
        needed = sum(m.get_num_blocks_to_allocate(t, num_tokens) for m, t in pairs)
        if reserve_tokens:
            needed = max(
                needed, sum(m.get_num_blocks_to_allocate(t, reserve_tokens, capped=True) for m, t in pairs)
            )
        return revived + needed

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_computed_tokens: int | None = None,
        new_computed_blocks: ComputedBlocks | None = None,
        reserve_tokens: int = 0,
    ) -> bool:
        """Blocks for the request's next `num_new_tokens` tokens, all or nothing; False if the pool is short.

        A running request continues from its `num_computed_tokens`. A waiting one is admitted with its cache hit
        (`new_computed_blocks`, from `get_computed_blocks`) and the tokens the scheduler counts computed
        (`num_computed_tokens`: the hit, or more when K/V computed elsewhere is loaded), with `reserve_tokens` as
        in `get_num_blocks_to_admit`. The blocks the new tokens fill are published at once.
        """
        if new_computed_blocks is None:
            start = request.num_computed_tokens
        else:
            start = (
                new_computed_blocks.num_computed_tokens
                if num_computed_tokens is None
                else num_computed_tokens
            )
            if not self._admit(request, new_computed_blocks, start + num_new_tokens, reserve_tokens):
                return False
        return self._grow(request, start, start + num_new_tokens)

    def _grow(self, request: Request, start: int, end: int) -> bool:
        """Free the blocks no query from `start` on reads, then give each table the blocks it lacks for `end`
        tokens (all or none: False if the pool is short), and publish the blocks those tokens fill."""
        rid = request.request_id
        assert rid is not None
        managers = self.managers
        for m in managers:
            m.remove_skipped_blocks(rid, start)
        total = cdiv(end, self.block_size)
        # The common decode step stays inside its last block: nothing to allocate, nothing to count
        if any(len(m.req_to_blocks[rid]) < total for m in managers):
            if (
                sum(m.get_num_blocks_to_allocate(m.req_to_blocks[rid], end) for m in managers)
                > self.num_free_blocks
            ):
                return False
            for m in managers:
                m.allocate_new_blocks(rid, end)
        if self.enable_prefix_caching:
            for m in managers:
                m.cache_blocks(request, end)
        return True

    def _admit(self, request: Request, hit: ComputedBlocks, num_tokens: int, reserve_tokens: int) -> bool:
        """Take a waiting request's hit blocks, if the blocks it needs now are free, and count the lookup."""
        if request.external is not None and self.num_groups > 1:
            raise ValueError("loading K/V computed elsewhere needs one KV-cache group (not a hybrid model)")
        if self.get_num_blocks_to_admit(hit, num_tokens, reserve_tokens) > self.num_free_blocks:
            return False
        rid = request.request_id
        assert rid is not None
        for m, table in zip(self.managers, hit.blocks, strict=True):
            self.block_pool.touch(b for b in table if b != NULL_BLOCK)
            m.save_new_computed_blocks(rid, table)
        cached = hit.num_computed_tokens
        if request.num_preemptions:
            # All but the last token are computed again, less what the cache still holds
            self.num_recomputed_tokens += request.num_tokens - 1 - cached
        elif self.enable_prefix_caching:
            # A request re-admitted after preemption finds its own blocks again: recomputation saved, not sharing
            self.prefix_cache_stats = self.prefix_cache_stats.record(request.num_tokens, cached)
        return True

    def free(self, request: Request) -> None:
        """Give back the request's blocks, group by group, last block first (its tail is evicted first)."""
        assert request.request_id is not None
        for m in self.managers:
            m.free(request.request_id)

    def used_token_slots(self, seqs: Iterable[Request]) -> int:
        """Token slots of the pool that hold a computed token (a shared block counts once)."""
        bs = self.block_size
        if not self.enable_prefix_caching and not self.has_sliding_groups:
            # No block is shared and no entry is null: each table's computed tokens fill its blocks in order
            return sum(
                min(seq.num_computed_tokens, len(t) * bs)
                for seq in seqs
                for t in self.get_block_ids(seq.request_id)
            )
        # Blocks before a request's last computed block are full; only that block is partly filled. A set of the
        # full ones counts a shared block once.
        full: set[int] = set()
        partial: dict[int, int] = {}
        for seq in seqs:
            whole, rest = divmod(seq.num_computed_tokens, bs)
            for table in self.get_block_ids(seq.request_id):
                full.update(table[:whole])
                if rest and whole < len(table) and partial.get(table[whole], 0) < rest:
                    partial[table[whole]] = rest
        full.discard(NULL_BLOCK)
        return bs * len(full) + sum(n for b, n in partial.items() if b not in full and b != NULL_BLOCK)


class ContiguousBlockManager(BlockManager):
    """Pre-paging allocation: each request reserves one contiguous run of blocks for `max_model_len` tokens.

    The run is found first-fit among free blocks, so fragmentation between runs is real too. No sharing.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.reserve_blocks = cdiv(max_model_len, block_size)
        if self.reserve_blocks > num_blocks:
            raise ValueError(
                f"max_model_len={max_model_len} does not fit in {num_blocks} blocks of {block_size}"
            )

    def _first_fit(self) -> int | None:
        run = 0
        for block_id, refs in enumerate(self.block_pool.ref_cnt):
            run = run + 1 if refs == 0 else 0
            if run == self.reserve_blocks:
                return block_id - run + 1
        return None

    def get_num_blocks_to_admit(self, hit: ComputedBlocks, num_tokens: int, reserve_tokens: int = 0) -> int:
        return self.reserve_blocks

    def _admit(self, request: Request, hit: ComputedBlocks, num_tokens: int, reserve_tokens: int) -> bool:
        """Reserve the first free run of blocks long enough for `max_model_len` tokens."""
        if request.external is not None:
            raise ValueError(
                "the contiguous baseline cannot load K/V computed elsewhere; use the paged layout"
            )
        start = self._first_fit()
        if start is None:
            return False
        blocks = list(range(start, start + self.reserve_blocks))
        self.block_pool.touch(blocks)
        assert request.request_id is not None
        self.managers[0].save_new_computed_blocks(request.request_id, blocks)
        return True

    def _grow(self, request: Request, start: int, end: int) -> bool:
        # Everything up to max_model_len was reserved at admission
        assert request.request_id is not None
        manager = self.managers[0]
        return manager.get_num_blocks_to_allocate(manager.req_to_blocks[request.request_id], end) == 0
