"""One KV-cache group's block tables, one class per attention kind.

Every request holds one block table per KV-cache group, and each group's manager keeps them, keyed by request
id, with how many leading full blocks it has offered to the prefix cache. All managers draw on one `BlockPool`.
What differs between attention kinds is which earlier blocks a query still reads, and so:
- which cached prefix a group can serve (`find_longest_cache_hit`);
- which blocks it frees as a request grows (`get_num_skipped_blocks`, `remove_skipped_blocks`);
- which full blocks it publishes (`is_retained`), and how many blocks one request can hold (`admission_cap`).

`FullAttentionManager` reads every earlier token. `SlidingWindowManager` reads the last `window` tokens, so a
request holds the window's blocks plus those being written, however long it grows. vLLM v1 has the same
split. Chapters 6, 7 and 9.
"""

from __future__ import annotations

from typing import ClassVar

from kvlab.engine.block_pool import NULL_BLOCK, BlockPool
from kvlab.engine.request import Request
from kvlab.units import cdiv


def max_admission_blocks(window: int, block_size: int, in_flight: int, num_tokens: int | None = None) -> int:
    """Most blocks a sliding group of `window` holds for one request at once: the window's `window - 1` earlier
    tokens plus the `in_flight` tokens scheduled at once, at most `num_tokens`, and one block more, since the
    window may start inside a block (vLLM's `max_admission_blocks_per_request`, both for sizing and admission)."""
    tokens = window - 1 + in_flight
    return cdiv(tokens if num_tokens is None else min(tokens, num_tokens), block_size) + 1


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group (number `group`), on the shared `pool`."""

    window: int | None = None
    kind: ClassVar[str]

    def __init__(self, group: int, pool: BlockPool, block_size: int, enable_caching: bool) -> None:
        self.group = group
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[int]] = {}
        # Leading full blocks already offered to the prefix cache since the request was given its blocks
        self.num_cached_block: dict[str, int] = {}
        # Most blocks one request holds at once, where the kind bounds it (None: its whole context)
        self.admission_cap: int | None = None

    def get_num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query from `num_computed_tokens` on reads."""
        return 0

    def find_longest_cache_hit(self, hashes: list[int], limit: int) -> int:
        """Leading blocks, at most `limit`, of a prompt with these block hashes that this group serves from cache."""
        cached, group = self.pool.cached_block_hash_to_block, self.group
        n = 0
        while n < limit and (group, hashes[n]) in cached:
            n += 1
        return n

    def hit_blocks(self, hashes: list[int], num_blocks: int) -> list[int]:
        """The block table of a hit of `num_blocks` blocks: the first cached copy of each block it still reads."""
        first = self.get_num_skipped_blocks(num_blocks * self.block_size)
        cached, group = self.pool.cached_block_hash_to_block, self.group
        return [NULL_BLOCK] * first + [next(iter(cached[(group, h)])) for h in hashes[first:num_blocks]]

    def is_retained(self, index: int, request: Request) -> bool:
        """Whether full block `index` of `request` is published for later hits."""
        return True

    def get_num_blocks_to_allocate(self, table: list[int], num_tokens: int, capped: bool = False) -> int:
        """Blocks `table` lacks to hold `num_tokens` tokens; with `capped`, at most its `admission_cap`."""
        total = cdiv(num_tokens, self.block_size)
        if capped and self.admission_cap is not None:
            total = min(total, self.admission_cap)
        return max(0, total - len(table))

    def save_new_computed_blocks(self, request_id: str, blocks: list[int]) -> None:
        """Give a request being admitted its cached blocks (the pool has counted the new references)."""
        self.req_to_blocks[request_id] = blocks
        self.num_cached_block[request_id] = 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        """Fresh blocks, so that the request's table holds `num_tokens` tokens."""
        table = self.req_to_blocks[request_id]
        missing = cdiv(num_tokens, self.block_size) - len(table)
        if missing > 0:
            table += self.pool.get_new_blocks(missing)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no query from `num_computed_tokens` on reads (nothing, for full attention)."""

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the blocks that `num_tokens` tokens fill, so that later requests can share them.

        It happens when the tokens are scheduled, not after they are computed: a request admitted later in the
        same step can already share them, since every layer writes the whole step's K/V before any attends.
        A block cached already (a hit), null or not retained is skipped.
        """
        rid = request.request_id
        assert rid is not None
        first, full = self.num_cached_block[rid], num_tokens // self.block_size
        if full <= first:
            return
        self.num_cached_block[rid] = full
        hashes = request.update_block_hashes(self.block_size)
        table, keys = self.req_to_blocks[rid], self.pool.block_keys
        for i in range(first, full):
            block_id = table[i]
            if block_id == NULL_BLOCK or keys[block_id] is not None or not self.is_retained(i, request):
                continue
            self.pool.cache_full_block(block_id, (self.group, hashes[i]))

    def free(self, request_id: str) -> None:
        """Give the request's blocks back, last first, so that its tail is evicted before its shared head."""
        table = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.pool.free_blocks(b for b in reversed(table) if b != NULL_BLOCK)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every earlier token is read, so every block is kept and every full block published."""

    kind = "full"


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention of `window` tokens.

    `retention_interval` (vLLM's `prefix_cache_retention_interval`): 0 publishes only the blocks a resent
    prompt or a shared-prefix junction can hit; a positive multiple of the block size also the window's blocks
    at the end of every interval; None every full block. `admission_cap` bounds what one request holds.
    """

    kind = "sliding"

    def __init__(
        self,
        group: int,
        pool: BlockPool,
        block_size: int,
        enable_caching: bool,
        window: int,
        retention_interval: int | None,
        in_flight: int | None,
        max_model_len: int | None,
    ) -> None:
        super().__init__(group, pool, block_size, enable_caching)
        self.window = window
        self.retention_interval = retention_interval
        if in_flight is not None:
            self.admission_cap = max_admission_blocks(window, block_size, in_flight, max_model_len)

    def get_num_skipped_blocks(self, num_computed_tokens: int) -> int:
        assert self.window is not None
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def find_longest_cache_hit(self, hashes: list[int], limit: int) -> int:
        """The longest prefix whose blocks inside the window, at the first token to compute, are all cached."""
        cached, group = self.pool.cached_block_hash_to_block, self.group
        for n in range(limit, 0, -1):
            first = self.get_num_skipped_blocks(n * self.block_size)
            if all((group, hashes[i]) in cached for i in range(first, n)):
                return n
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        table = self.req_to_blocks[request_id]
        skipped = min(self.get_num_skipped_blocks(num_computed_tokens), len(table))
        freed = []
        # Last first, as vLLM does; stop at what is already null
        for i in range(skipped - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            freed.append(table[i])
            table[i] = NULL_BLOCK
        self.pool.free_blocks(freed)

    def is_retained(self, index: int, request: Request) -> bool:
        """A hit needs the cdiv(window - 1, block_size) blocks before the point it resumes at: the prompt's last
        token (a resend computes it again), a shared-prefix junction, and with an interval the end of each."""
        interval = self.retention_interval
        if interval is None:
            return True
        assert self.window is not None
        need = cdiv(self.window - 1, self.block_size)
        if interval:
            per_interval = interval // self.block_size
            if need >= per_interval or index % per_interval >= per_interval - need:
                return True
        for boundary in (request.num_prompt_tokens - 1, request.shared_prefix_boundary):
            end = boundary // self.block_size
            if end - need <= index < end:
                return True
        return False
