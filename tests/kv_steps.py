"""What the scheduler does with a KV-cache manager, for the tests that drive a `BlockManager` alone.

The scheduler alone advances a request's `num_computed_tokens` (kvlab.engine.scheduler); these helpers play that
part, so the manager tests read as the scheduler's calls do.
"""

from kvlab.engine.block_manager import BlockManager
from kvlab.engine.request import Request


def admit(bm: BlockManager, seq: Request, num_new_tokens: int, reserve_tokens: int = 0) -> int | None:
    """Admit a waiting request with its cached prefix and blocks for up to `num_new_tokens` more: the tokens it
    computes now (the hit is counted computed), or None when the pool is short."""
    hit = bm.get_computed_blocks(seq)
    n = min(num_new_tokens, seq.num_tokens - hit.num_computed_tokens)
    seq.shared_prefix_boundary = hit.shared_prefix_boundary
    if not bm.allocate_slots(seq, n, hit.num_computed_tokens, hit, reserve_tokens):
        return None
    seq.num_computed_tokens = hit.num_computed_tokens
    return n


def hit_table(bm: BlockManager, seq: Request, group: int = 0) -> list[int]:
    """The blocks a lookup of `seq` would take, in one group (the first by default)."""
    return bm.get_computed_blocks(seq).blocks[group]


def table(bm: BlockManager, seq: Request, group: int = 0) -> list[int]:
    """The request's block table in one group."""
    return bm.get_block_ids(seq.request_id)[group]
