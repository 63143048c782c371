from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_steps import admit, hit_table, table

from kvlab.engine.block_manager import (
    NULL_BLOCK,
    BlockManager,
    ContiguousBlockManager,
    blocks_per_request,
    longest_request,
)
from kvlab.engine.block_pool import BlockPool, hash_block_tokens
from kvlab.engine.metrics import PrefixCacheStats
from kvlab.engine.request import Request


def check_invariants(bm: BlockManager, live: list[Request]) -> None:
    pool = bm.block_pool
    assert all(r >= 0 for r in pool.ref_cnt)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    # A block is free exactly when nobody references it, and its count is the number of tables holding it.
    holders = [0] * bm.num_blocks
    for seq in live:
        assert len(set(table(bm, seq))) == len(table(bm, seq))
        for block_id in table(bm, seq):
            holders[block_id] += 1
    assert holders == pool.ref_cnt
    assert set(pool.free_block_queue) == {b for b, r in enumerate(pool.ref_cnt) if r == 0}
    # The prefix cache maps each hash to the blocks carrying it (duplicates kept), and every hashed block is there.
    index = pool.cached_block_hash_to_block
    assert all(blocks and all(pool.block_keys[b] == h for b in blocks) for h, blocks in index.items())
    assert sum(h is not None for h in pool.block_keys) == bm.num_cached_blocks
    # Requests that hold no blocks leave no entry behind
    assert all(set(m.req_to_blocks) == {s.request_id for s in live} for m in bm.managers)


def free_all_and_check(bm: BlockManager, slots: dict[int, Request]) -> None:
    """After every request ends, every block is free again."""
    for seq in slots.values():
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == bm.num_blocks


# An operation: (kind, sequence slot, a number). Tokens come from a 2-letter alphabet so prefixes repeat.
ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 5), st.integers(1, 12)), max_size=40
)


def apply_ops(bm: BlockManager, ops, computed_before_grow) -> Iterator[dict[int, Request]]:
    """Run `ops` on `bm`, yielding the live sequences by slot after each. Before a "grow", a sequence has
    `computed_before_grow(seq, n)` tokens computed; then it asks for `n` more generated tokens' slots."""
    slots: dict[int, Request] = {}
    for kind, slot, n in ops:
        seq = slots.get(slot)
        if kind == "admit" and seq is None:
            seq = Request([2 + (slot * i) % 2 for i in range(n)])
            if admit(bm, seq, n) is not None:
                slots[slot] = seq
                assert (
                    seq.num_computed_tokens % bm.block_size == 0 and seq.num_computed_tokens < seq.num_tokens
                )
        elif kind == "grow" and seq is not None:
            seq.num_computed_tokens = min(computed_before_grow(seq, n), seq.num_tokens)
            seq.token_ids.extend([3] * n)
            if not bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
                bm.free(seq)
                del slots[slot]
        elif kind == "free" and seq is not None:
            bm.free(seq)
            del slots[slot]
        yield slots


@settings(max_examples=60, deadline=None)
@given(ops=ops, prefix_caching=st.booleans(), block_size=st.sampled_from([1, 2, 4]))
def test_block_manager_never_leaks(ops, prefix_caching, block_size):
    bm = BlockManager(num_blocks=12, block_size=block_size, enable_prefix_caching=prefix_caching)
    slots: dict[int, Request] = {}
    # Everything scheduled was computed
    for slots in apply_ops(bm, ops, lambda seq, n: len(table(bm, seq)) * block_size):
        check_invariants(bm, list(slots.values()))
    free_all_and_check(bm, slots)


def filled_slots_by_walk(bm: BlockManager, seqs: list[Request]) -> int:
    """`used_token_slots` by its definition: every block of every table, a shared block at its fullest."""
    filled: dict[int, int] = {}
    for seq in seqs:
        for blocks in bm.get_block_ids(seq.request_id):
            for i, block_id in enumerate(blocks):
                if block_id != NULL_BLOCK:
                    n = min(bm.block_size, max(0, seq.num_computed_tokens - i * bm.block_size))
                    filled[block_id] = max(filled.get(block_id, 0), n)
    return sum(filled.values())


@settings(max_examples=60, deadline=None)
@given(
    ops=ops,
    prefix_caching=st.booleans(),
    block_size=st.sampled_from([1, 2, 4]),
    windows=st.sampled_from([(None,), (None, 4)]),
)
def test_used_token_slots_counts_each_filled_slot_once(ops, prefix_caching, block_size, windows):
    bm = BlockManager(
        num_blocks=24, block_size=block_size, enable_prefix_caching=prefix_caching, windows=windows
    )
    # Part of what was scheduled is computed, so last blocks are partly filled too
    for slots in apply_ops(bm, ops, lambda seq, n: seq.num_computed_tokens + n // 2 + 1):
        live = list(slots.values())
        assert bm.used_token_slots(live) == filled_slots_by_walk(bm, live)


@settings(max_examples=40, deadline=None)
@given(ops=ops)
def test_contiguous_manager_reserves_runs_and_never_leaks(ops):
    bm = ContiguousBlockManager(num_blocks=16, block_size=2, max_model_len=7)
    slots: dict[int, Request] = {}
    for kind, slot, n in ops:
        seq = slots.get(slot)
        if kind == "admit" and seq is None:
            seq = Request([5] * min(n, 6))
            if admit(bm, seq, n) is not None:
                slots[slot] = seq
                run = table(bm, seq)
                assert run == list(range(run[0], run[0] + 4))  # one run of ceil(7 / 2) blocks
        elif kind == "free" and seq is not None:
            bm.free(seq)
            del slots[slot]
        check_invariants(bm, list(slots.values()))
    free_all_and_check(bm, slots)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), max_size=60))
def test_block_pool_counts(actions):
    pool = BlockPool(5)
    held: list[int] = []
    for take in actions:
        if take and pool.num_free_blocks:
            held += pool.get_new_blocks(1)
        elif held:
            pool.free_blocks([held.pop(0)])
        assert pool.num_free_blocks + len(held) == 5
    pool.free_blocks(held)
    assert pool.num_free_blocks == 5 and pool.num_evictions == 0
    with pytest.raises(ValueError):
        pool.free_blocks([0])
    with pytest.raises(MemoryError):
        pool.get_new_blocks(6)


def test_prefix_hits_need_the_whole_chain():
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    first = Request([7, 8, 9, 10, 11])
    assert admit(bm, first, 5) == 5
    same_head = Request([7, 8, 9, 10, 12, 13])
    assert hit_table(bm, same_head) == table(bm, first)[:2]
    # Block [9, 10] alone matches, but its parent differs: no hit.
    assert hit_table(bm, Request([1, 2, 9, 10, 11])) == []
    # A prompt made only of cached blocks still computes its last token.
    assert hit_table(bm, Request([7, 8, 9, 10])) == table(bm, first)[:1]


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = Request([1, 2, 3, 4, 5])
    admit(bm, a, 5)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.block_pool.cached_block_hash_to_block) == 2
    b = Request([1, 2, 3, 4, 6])
    assert admit(bm, b, 5) == 1  # four tokens came from the cache
    assert b.metrics.num_cached_tokens == 0  # the scheduler records it, not the manager
    assert bm.prefix_cache_stats == PrefixCacheStats(requests=2, queries=10, hits=4, hit_requests=1)
    bm.free(b)
    # New content needs all 4 blocks: the cached ones are evicted, oldest-freed first, and forgotten.
    c = Request([9] * 8)
    assert admit(bm, c, 8) == 8
    assert hit_table(bm, Request([1, 2, 3, 4, 5])) == []


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    seq = Request([1] * 5)
    assert admit(bm, seq, 5) == 5
    assert bm.num_free_blocks == 0
    other = Request([2] * 3)
    assert admit(bm, other, 3) is None
    assert table(bm, other) == [] and bm.num_free_blocks == 0


def test_predicted_fragmentation_counts_last_block_waste_and_entries():
    from kvlab.engine.metrics import predicted_fragmentation

    frag = predicted_fragmentation([1, 4, 5, 8], block_size=4)
    assert frag.last_block_waste == (3 + 0 + 3 + 0) / 4 and frag.table_entries == (1 + 1 + 2 + 2) / 4
    # Lengths spread evenly over a block: (B - 1) / 2 tokens wasted, whatever the lengths.
    assert predicted_fragmentation(range(100, 164), 16).last_block_waste == 7.5
    assert predicted_fragmentation(range(1, 50), 1).last_block_waste == 0
    with pytest.raises(ValueError):
        predicted_fragmentation([], 4)


def test_num_cached_blocks_outlives_the_request():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = Request(list(range(2, 12)))  # 10 tokens: 2 full blocks
    admit(bm, seq, 10)
    assert bm.num_cached_blocks == 2
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2


def test_hash_block_tokens_is_chained_stable_and_content_addressed():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, [1, 2, 3, 4])  # not seeded per process, unlike hash()
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8]
    )
    assert 0 < root < 2**128


def test_free_queue_order_matches_vllm():
    """vLLM 0.33.0 `BlockPool.free_blocks`: freed blocks without a hash go to the front (reused first), cached ones to
    the back in the order freed; a request's blocks are freed tail first. Expected orders derived by hand."""
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)

    def free():
        return list(bm.block_pool.free_block_queue)

    a = Request([1, 2, 3, 4, 5])  # blocks 0, 1 full (cached), block 2 partial
    assert admit(bm, a, 5) == 5 and table(bm, a) == [0, 1, 2] and free() == [3, 4, 5]
    bm.free(a)  # freed 2, 1, 0: the partial 2 to the front; cached 1 then 0 to the back
    assert free() == [2, 3, 4, 5, 1, 0]
    b = Request([9, 9, 8, 8, 7, 7, 6])  # unrelated: takes the four uncached blocks first
    assert admit(bm, b, 7) == 7 and table(bm, b) == [2, 3, 4, 5] and free() == [1, 0]
    c = Request([5, 5, 4])  # needs two blocks: evicts A's tail block 1 before its head block 0
    assert admit(bm, c, 3) == 3 and table(bm, c) == [1, 0] and bm.num_cached_blocks == 4  # b's 3 + c's 1
    bm.free(c)
    bm.free(b)
    # c freed 0 (partial, front) then 1 (cached, back); b freed 5 (partial, front), then 4, 3, 2 (cached, back).
    assert free() == [5, 0, 1, 4, 3, 2]
    # Without prefix caching nothing is cached: every freed block goes to the front, last freed first.
    plain = BlockManager(num_blocks=4, block_size=2)
    d = Request([1, 2, 3, 4, 5])
    admit(plain, d, 5)
    plain.free(d)
    assert list(plain.block_pool.free_block_queue) == [2, 1, 0, 3]


def test_cache_salt_changes_every_block_hash():
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    tokens = [3, 4, 5, 6, 7]
    salted = Request(tokens, cache_salt="a")
    assert admit(bm, salted, 5) == 5
    assert hit_table(bm, Request(tokens + [1], cache_salt="b")) == []
    assert hit_table(bm, Request(tokens + [1])) == []
    assert hit_table(bm, Request(tokens + [1], cache_salt="a")) == table(bm, salted)[:2]
    with pytest.raises(ValueError, match="cache_salt"):
        Request(tokens, cache_salt=1)  # type: ignore[arg-type]


def test_sliding_group_frees_behind_the_window_and_hits_on_the_window_only():
    # Every full sliding block cached (retention None), so that a prefix shorter than the prompt can hit.
    bm = BlockManager(
        num_blocks=32,
        block_size=2,
        enable_prefix_caching=True,
        windows=[5],
        prefix_cache_retention_interval=None,
    )
    seq = Request(list(range(10, 30)))
    assert admit(bm, seq, 4) == 4  # tokens 0..3
    seq.num_computed_tokens = 4
    assert bm.allocate_slots(seq, 4)  # next query at 4 reads from token 0: nothing skipped yet
    assert table(bm, seq) == [0, 1, 2, 3]
    seq.num_computed_tokens = 8
    assert bm.allocate_slots(seq, 4)  # query at 8 reads tokens 4..: blocks 0, 1 (tokens 0..3) freed
    assert table(bm, seq)[:2] == [NULL_BLOCK] * 2 and bm.num_used_blocks == 4
    # A later request with the same first 12 tokens hits on the blocks its window still reads (tokens 8..11).
    other = Request(list(range(10, 22)) + [99])
    tables = bm.get_computed_blocks(other).blocks
    assert tables[0][:4] == [NULL_BLOCK] * 4 and len(tables[0]) == 6


@pytest.mark.parametrize("windows", [[None], [None, 8], [8, 8], [None, None]])
def test_longest_request_is_the_longest_whole_block_count_that_fits(windows):
    """The bisection finds what a block-by-block search finds: the most whole blocks whose request fits."""
    bs, chunk = 4, 16
    for num_blocks in range(1, 40):
        for limit in (7, 64, 1000):
            expected = limit
            if blocks_per_request(windows, bs, chunk, limit) > num_blocks:
                k = 0
                while blocks_per_request(windows, bs, chunk, (k + 1) * bs) <= num_blocks:
                    k += 1
                expected = k * bs
            assert longest_request(windows, num_blocks, bs, chunk, limit) == expected


def test_max_concurrency_counts_a_sliding_group_at_its_window():
    full = BlockManager(64, 4)
    assert full.max_concurrency(32, 16) == 64 / 8
    hybrid = BlockManager(64, 4, windows=[None, 8])
    # The sliding group holds cdiv(8 - 1 + 16, 4) + 1 = 7 blocks however long the request grows.
    assert hybrid.max_concurrency(32, 16) == 64 / (8 + 7)
