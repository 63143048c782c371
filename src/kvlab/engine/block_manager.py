"""Which blocks of the pool each sequence owns: the allocator, prefix caching, and the contiguous baseline.

`BlockAllocator` keeps a reference count per block and a free list in eviction order. `BlockManager` gives each
sequence a block table and, with prefix caching, shares full blocks between sequences (Kwon et al., 2023,
arXiv:2309.06180, and vLLM's automatic prefix caching): a full block is identified by a hash of its tokens chained
with its parent block's hash, so equal hashes mean equal whole prefixes. A block whose last user finishes keeps its
hash and stays on the free list; a later request with the same prefix takes it back, and only when the allocator
needs a fresh block is the least recently freed one evicted.

Three rules follow vLLM 0.33.0 where its tests pin them down (`tests/v1/core/test_prefix_caching.py`):
- Duplicates stay cached. A hash maps to every block that holds it (`vllm/v1/core/block_pool.py`,
  `BlockHashToBlockMap`: "we don't de-duplicate the blocks in the cache"), and a lookup takes the first one
  cached. A block-aligned prompt sent again recomputes its last block, which joins the first copy under the same
  hash; evicting one copy leaves the other.
- Sliding-window groups keep only the blocks a hit can reach (`prefix_cache_retention_interval`, 0 by default
  in `vllm/config/cache.py`; `SlidingWindowManager.reachable_block_mask` in
  `vllm/v1/core/single_type_kv_cache_manager.py`): with 0, the window's blocks before the prompt's last token
  (where a resend of the prompt resumes) and before a shared-prefix junction; a positive interval adds the
  window's blocks at the end of every interval; `None` caches every full block. Full-attention groups cache every
  full block.
- Admission with the whole prompt reserved (vLLM's `scheduler_reserve_full_isl`) caps a sliding group at what it
  can hold at once, the window plus the tokens in flight (`SlidingWindowSpec.max_admission_blocks_per_request`,
  `vllm/v1/kv_cache_interface.py`, applied with `apply_admission_cap` in `vllm/v1/core/kv_cache_manager.py`).

`ContiguousBlockManager` is what servers did before paging: reserve `max_model_len` tokens of contiguous memory
per request at admission. On the same pool and trace, it shows how much reserved memory holds no token.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

from kvlab.engine.metrics import PrefixCacheStats
from kvlab.engine.request import Request
from kvlab.units import cdiv

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


def max_admission_blocks(
    window: int, block_size: int, max_in_flight_tokens: int, max_model_len: int | None = None
) -> int:
    """Most blocks a sliding group of `window` holds for one request at once: the window's `window - 1` earlier
    tokens plus the tokens in flight, at most `max_model_len`, and one block more because the window may start
    inside a block (vLLM 0.33.0 `SlidingWindowSpec.max_admission_blocks_per_request`,
    `vllm/v1/kv_cache_interface.py`: both the start-up pool sizing and the admission cap)."""
    tokens = window - 1 + max_in_flight_tokens
    return cdiv(tokens if max_model_len is None else min(tokens, max_model_len), block_size) + 1


def blocks_per_request(
    windows: Sequence[int | None], block_size: int, max_num_batched_tokens: int, context_len: int
) -> int:
    """Most blocks one request of `context_len` tokens holds over all KV-cache groups: a sliding group at most
    `max_admission_blocks` (vLLM 0.33.0 `SlidingWindowSpec.max_memory_usage_bytes`)."""
    return sum(
        cdiv(context_len, block_size)
        if w is None
        else max_admission_blocks(w, block_size, max_num_batched_tokens, context_len)
        for w in windows
    )


def check_retention_interval(interval: int | None, block_size: int) -> None:
    """vLLM 0.33.0's `prefix_cache_retention_interval` values: None, 0, or a positive multiple of the block size."""
    if interval is None:
        return
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0 or interval % block_size:
        raise ValueError(
            f"prefix_cache_retention_interval must be None, 0 or a positive multiple of block_size={block_size},"
            f" got {interval!r}"
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

    `windows` lists the KV-cache groups of the model (`kvlab.engine.kv_pool.kv_cache_groups`): `None` for a group of
    full-attention layers, the window for a group of sliding-window layers. Each sequence keeps one block table
    per group (vLLM's hybrid KV cache manager); all groups draw blocks from one allocator. A sliding group frees
    the blocks that fall wholly behind its window before each step (vLLM's `SlidingWindowManager`
    `remove_skipped_blocks`): their table entries become `NULL_BLOCK`, so a sequence holds the window's blocks
    plus the blocks being written, however long it grows.

    `prefix_cache_retention_interval` is vLLM's knob of that name (0, vLLM's default: a sliding group caches only
    the blocks a replayed prompt or a shared-prefix junction can hit; a positive multiple of `block_size`: also
    the window's blocks at the end of every interval; None: every full block). `max_in_flight_tokens` (the
    engine's `max_num_batched_tokens`) and `max_model_len` set a sliding group's admission cap
    (`max_admission_blocks`); with neither, a whole-prompt reservation counts every prompt block.
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
        # One table per sequence, never freed behind a window: `append_slots` takes its fast path
        self.single_full_group = list(windows) == [None]
        check_retention_interval(prefix_cache_retention_interval, block_size)
        if prefix_cache_retention_interval and not self.has_sliding_groups:
            # vLLM 0.33.0 refuses it too (`_validate_prefix_cache_retention_interval`, kv_cache_coordinator.py).
            raise ValueError(
                f"prefix_cache_retention_interval={prefix_cache_retention_interval} has no effect without a"
                " sliding-window KV-cache group; leave it 0"
            )
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows)
        self.prefix_cache_retention_interval = prefix_cache_retention_interval
        # vLLM's KVCacheManager takes max_model_len as the tokens in flight when it is given no other bound.
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        self.admission_caps: list[int | None] = [
            None
            if w is None or in_flight is None
            else max_admission_blocks(w, block_size, in_flight, max_model_len)
            for w in windows
        ]
        # (group, block hash) -> every block holding it, first cached first (vLLM keeps duplicates).
        self.cached: dict[tuple[int, int], dict[int, None]] = {}
        self.block_group = [0] * num_blocks  # which group a block in use belongs to
        self.allocator.on_evict = self._evict
        self.prefix_cache_stats = PrefixCacheStats()  # lookups so far, one per request
        self.num_recomputed_tokens = 0  # tokens prefilled again after a preemption (cache hits excluded)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a published prefix, in use or free but not yet evicted (duplicates counted)."""
        return sum(len(blocks) for blocks in self.cached.values())

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
        """Forget one block's copy of a hash; another copy of the same hash stays cached."""
        blocks = self.cached.get(key)  # type: ignore[call-overload]
        if blocks is not None and block_id in blocks:
            del blocks[block_id]
            if not blocks:
                del self.cached[key]  # type: ignore[arg-type]

    def _hashes(self, seq: Request) -> list[int]:
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

    def cached_prefix(self, seq: Request) -> list[int]:
        """Cached blocks covering the longest prefix of `seq`, leaving at least one token to compute (the first
        KV-cache group's table; `cached_tables` gives every group's)."""
        return self.cached_tables(seq)[0]

    def cached_tables(self, seq: Request) -> list[list[int]]:
        """Per group, the table of cached blocks covering the longest prefix of `seq` every group can serve,
        leaving at least one token to compute (`NULL_BLOCK` where a sliding group no longer needs a block).

        As vLLM 0.33.0's `HybridKVCacheCoordinator.find_longest_cache_hit`, each group in turn (full attention
        first) may shorten the candidate until none does. Where the first group alone would hit further, its
        hit ends on a shared prefix that a sliding group has not kept: that junction is recorded in
        `seq.shared_prefix_boundary`, so this request keeps its window there for the next one.
        """
        if not self.enable_prefix_caching:
            return [[] for _ in self.windows]
        hashes = self._hashes(seq)
        n = (seq.num_tokens - 1) // self.block_size
        longest = None
        while True:
            start = n
            for g in range(self.num_groups):
                n = self._group_hit(g, hashes, n)
                longest = n if longest is None else longest
            if n == start:
                break
        seq.shared_prefix_boundary = longest * self.block_size if longest and longest > n else 0
        tables = []
        for g in range(self.num_groups):
            first = self._skipped_blocks(g, n * self.block_size)
            tables.append([NULL_BLOCK] * first + [next(iter(self.cached[(g, h)])) for h in hashes[first:n]])
        return tables

    def _new_blocks_needed(self, seq: Request, num_new_tokens: int) -> int:
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return sum(max(0, total - len(table)) for table in seq.block_tables)

    def _blocks_beyond(self, tables: list[list[int]], num_tokens: int, capped: bool = False) -> int:
        """Blocks the tables lack to hold `num_tokens` tokens, each sliding group at most its admission cap when
        `capped` (vLLM 0.33.0 `SingleTypeKVCacheManager.get_num_blocks_to_allocate`)."""
        total = cdiv(num_tokens, self.block_size)
        return sum(
            max(0, (total if cap is None or not capped else min(total, cap)) - len(table))
            for table, cap in zip(tables, self.admission_caps, strict=True)
        )

    def _admission(
        self, seq: Request, num_new_tokens: int, reserve_tokens: int
    ) -> tuple[list[list[int]], int, int]:
        """A waiting sequence's cached tables, the tokens it would compute now, and the free blocks it needs."""
        tables = self.cached_tables(seq)
        cached = len(tables[0]) * self.block_size
        # Tokens whose K/V another engine computed count as computed, beyond what the prefix cache serves; after a
        # preemption they are recomputed here, as in vLLM.
        external = (
            seq.external.num_tokens if seq.external is not None and not seq.metrics.num_preemptions else 0
        )
        computed = max(cached, external)
        num_new_tokens = min(num_new_tokens, seq.num_tokens - computed)
        hits = {b for table in tables for b in table if b != NULL_BLOCK}
        # Cached but free: they leave the free list.
        revived = sum(self.allocator.ref_counts[b] == 0 for b in hits)
        needed = self._blocks_beyond(tables, computed + num_new_tokens)
        if reserve_tokens:
            # vLLM's `full_sequence_must_fit` gate: the whole prompt, sliding groups capped, must fit as well.
            reserved = self._blocks_beyond(tables, min(reserve_tokens, seq.num_tokens), capped=True)
            needed = max(needed, reserved)
        return tables, num_new_tokens, revived + needed

    def blocks_to_admit(self, seq: Request, num_new_tokens: int, reserve_tokens: int = 0) -> int:
        """Free blocks `allocate(seq, num_new_tokens, reserve_tokens)` needs to admit `seq` now."""
        return self._admission(seq, num_new_tokens, reserve_tokens)[2]

    def can_fit_alone(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) * self.num_groups <= self.num_blocks

    def allocate(self, seq: Request, num_new_tokens: int, reserve_tokens: int = 0) -> int | None:
        """Admit a sequence holding no blocks: take its cached prefix, then blocks for up to `num_new_tokens`
        more. Returns how many tokens it will compute (the hit shortens the work), or None if the pool is short.

        `reserve_tokens`: admit only if blocks for that many tokens in all (the whole prompt: vLLM's
        `scheduler_reserve_full_isl`) would be free, a sliding group counted at most at its admission cap, though
        only the first chunk's blocks are taken now.
        """
        assert not any(seq.block_tables), "allocate is for sequences without blocks"
        if seq.external is not None and self.num_groups > 1:
            raise ValueError("loading K/V computed elsewhere needs one KV-cache group (not a hybrid model)")
        tables, num_new_tokens, needed = self._admission(seq, num_new_tokens, reserve_tokens)
        if needed > self.num_free_blocks:
            return None
        cached = len(tables[0]) * self.block_size
        for table in tables:
            for block_id in table:
                if block_id != NULL_BLOCK:
                    self.allocator.share(block_id)
        seq.block_tables = tables
        if seq.metrics.num_preemptions:
            self.num_recomputed_tokens += seq.num_tokens - 1 - cached  # all but the last are recomputed
        seq.num_computed_tokens = cached
        if seq.external is not None and not seq.metrics.num_preemptions:
            seq.external.start = min(cached, seq.external.num_tokens)
            seq.num_computed_tokens = max(cached, seq.external.num_tokens)
        # Hit statistics count each request once, at its first admission: a request re-admitted after
        # preemption finds its own blocks again, which is recomputation saved, not prefix sharing.
        if self.enable_prefix_caching and seq.metrics.num_preemptions == 0:
            self.prefix_cache_stats = self.prefix_cache_stats.record(seq.num_tokens, cached)
        self.append_slots(seq, num_new_tokens)
        return num_new_tokens

    def remove_skipped_blocks(self, seq: Request) -> None:
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

    def append_slots(self, seq: Request, num_new_tokens: int) -> bool:
        """Blocks for the next `num_new_tokens` tokens of a running sequence; all or nothing."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        if end <= seq.slot_limit:
            return True
        if self.single_full_group:
            return self._append_one_table(seq, end)
        self.remove_skipped_blocks(seq)
        total = cdiv(end, self.block_size)
        # The common decode step stays inside its last block: no allocation, so no free-block count either.
        if any(len(table) < total for table in seq.block_tables):
            if self._new_blocks_needed(seq, num_new_tokens) > self.num_free_blocks:
                return False
            for g, table in enumerate(seq.block_tables):
                for _ in range(total - len(table)):
                    block_id = self.allocator.allocate()
                    self.block_group[block_id] = g
                    table.append(block_id)
        self._cache_full_blocks(seq, end)
        return True

    def _append_one_table(self, seq: Request, end: int) -> bool:
        """`append_slots` for one full-attention group (no window, so nothing to free behind it), which also sets
        the sequence's slot limit: later steps need no work while their tokens stay inside its blocks and fill
        no block (each step publishes the blocks it fills, so a filled one must come here)."""
        table, bs = seq.block_tables[0], self.block_size
        missing = cdiv(end, bs) - len(table)
        if missing > 0:
            if missing > self.allocator.num_free_blocks:
                return False
            allocate = self.allocator.allocate
            for _ in range(missing):
                table.append(allocate())
        self._cache_full_blocks(seq, end)
        blocks = len(table)
        held = blocks * bs
        # What the table holds by the one rule that sizes tables (`cdiv`), not by a second copy of it.
        while held and cdiv(held, bs) > blocks:
            held -= bs
        if self.enable_prefix_caching:
            held = min(held, (end // bs + 1) * bs - 1)
        seq.slot_limit = held
        return True

    def _retained(self, group: int, index: int, seq: Request) -> bool:
        """Whether block `index` of `seq` in `group` is published (vLLM 0.33.0
        `SlidingWindowManager.reachable_block_mask`, no speculative decoding, hits aligned to the block size).

        A sliding hit needs the cdiv(window - 1, block_size) blocks before the point it resumes at. Those points
        are the prompt's last token (a resend of the prompt computes that token again), a shared-prefix junction,
        and with a positive interval the end of every interval.
        """
        window, interval = self.windows[group], self.prefix_cache_retention_interval
        if window is None or interval is None:
            return True
        need = cdiv(window - 1, self.block_size)
        if interval:
            per_interval = interval // self.block_size
            if need >= per_interval or index % per_interval >= per_interval - need:
                return True
        for boundary in (seq.num_prompt_tokens - 1, seq.shared_prefix_boundary):
            end = boundary // self.block_size
            if end - need <= index < end:
                return True
        return False

    def _cache_full_blocks(self, seq: Request, num_tokens: int) -> None:
        """Publish the blocks that `num_tokens` tokens fill, so other requests can share them.

        As in vLLM, this happens when the tokens are scheduled, not after they are computed: a request admitted
        later in the same step can already share them, because each layer writes the whole step's K/V to the pool
        before any sequence attends. A block whose hash is cached already is published beside the first copy, not
        instead of it (vLLM 0.33.0 `BlockPool.cache_full_blocks`); sliding groups publish only `_retained` blocks.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(seq)
        hashes_of = self.allocator.hashes
        first, full = seq.num_published_blocks, num_tokens // self.block_size
        if full <= first:
            return
        # Blocks before `first` were offered already: each is published, a hit on a published block, null
        # behind a window, or not retained (fixed at admission); none of that changes while the tables are held.
        seq.num_published_blocks = full
        for g, table in enumerate(seq.block_tables):
            for i in range(first, full):
                block_id = table[i]
                if block_id == NULL_BLOCK or hashes_of[block_id] is not None or not self._retained(g, i, seq):
                    continue
                key = (g, hashes[i])
                hashes_of[block_id] = key
                self.cached.setdefault(key, {})[block_id] = None

    def free(self, seq: Request) -> None:
        """Give back a sequence's blocks, group by group, last block first, so its tail is evicted before its
        shared head (vLLM's `SingleTypeKVCacheManager.free`)."""
        for table in seq.block_tables:
            self.allocator.release_all(b for b in reversed(table) if b != NULL_BLOCK)
        seq.block_tables = [[] for _ in self.windows]
        seq.num_computed_tokens = 0
        seq.slot_limit = 0
        seq.num_published_blocks = 0

    def used_token_slots(self, seqs: Iterable[Request]) -> int:
        """Token slots of the pool that hold a computed token (a shared block counts once)."""
        bs = self.block_size
        if not self.enable_prefix_caching and not self.has_sliding_groups:
            # No block is shared and no entry is null: each table's computed tokens fill its blocks in order.
            return sum(min(seq.num_computed_tokens, len(t) * bs) for seq in seqs for t in seq.block_tables)
        # Blocks before a sequence's last computed block are full; only that block is partly filled. A set of
        # the full ones (filled in C, once per step when stats are kept) counts a shared block once.
        full: set[int] = set()
        partial: dict[int, int] = {}
        for seq in seqs:
            whole, rest = divmod(seq.num_computed_tokens, bs)
            for table in seq.block_tables:
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
        for block_id, refs in enumerate(self.allocator.ref_counts):
            run = run + 1 if refs == 0 else 0
            if run == self.reserve_blocks:
                return block_id - run + 1
        return None

    def blocks_to_admit(self, seq: Request, num_new_tokens: int, reserve_tokens: int = 0) -> int:
        return self.reserve_blocks

    def allocate(self, seq: Request, num_new_tokens: int, reserve_tokens: int = 0) -> int | None:
        assert not seq.block_table, "allocate is for sequences without blocks"
        if seq.external is not None:
            raise ValueError(
                "the contiguous baseline cannot load K/V computed elsewhere; use the paged layout"
            )
        start = self._first_fit()
        if start is None:
            return None
        for block_id in range(start, start + self.reserve_blocks):
            self.allocator.share(block_id)
        seq.block_table = list(range(start, start + self.reserve_blocks))
        return min(num_new_tokens, seq.num_tokens)

    def append_slots(self, seq: Request, num_new_tokens: int) -> bool:
        # Everything up to max_model_len was reserved at admission.
        return self._new_blocks_needed(seq, num_new_tokens) == 0
