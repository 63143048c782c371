"""The engine's block manager and scheduler where vLLM 0.33.0's own tests pin its behaviour down.

Each test states the behaviour vLLM documents (its source and `tests/v1/core/`), and derives the expected block
ids, free-queue orders and hit lengths by hand from vLLM's rules, not from kvlab's code:
- duplicates stay cached (`vllm/v1/core/block_pool.py`, `BlockHashToBlockMap`);
- sliding-window groups capped at admission (`SlidingWindowSpec.max_admission_blocks_per_request`);
- sliding-window prefix-cache retention (`prefix_cache_retention_interval`, `reachable_block_mask`);
- and, kvlab's own rule, a scheduler that cannot progress raises instead of spinning.
"""

import pytest
import torch
from kv_steps import admit, hit_table, table

from kvlab.engine import LLMEngine
from kvlab.engine.block_manager import NULL_BLOCK, BlockManager, ComputedBlocks
from kvlab.engine.config import VLLM_DEFAULTS, EngineConfig, SchedulerConfig
from kvlab.engine.outputs import RunnerOutput
from kvlab.engine.request import Request, SamplingParams
from kvlab.engine.scheduler import Scheduler, SchedulerStalled
from kvlab.engine.single_type_kv_cache_manager import max_admission_blocks
from kvlab.models import tiny_model
from kvlab.specs import vllm_defaults

KNOBS = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)


def compute_whole_prompt(bm: BlockManager, seq: Request) -> int | None:
    """Admit `seq` with its whole prompt in one chunk (what the scheduler does with a large token budget)."""
    return admit(bm, seq, seq.num_tokens)


# --- Duplicates stay cached -------------------------------------------------------------------------------------


def test_a_block_aligned_prompt_sent_again_caches_a_duplicate_that_outlives_the_original():
    """A resend of a block-aligned prompt hits all but its last block, which it recomputes (the last token is
    computed for its logits: `get_computed_blocks` caps the hit at num_tokens - 1). vLLM caches the recomputed
    block beside the first copy under the same hash; both go to the back of the free queue when freed."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)

    def free():
        return list(bm.block_pool.free_block_queue)

    prompt = list(range(1, 9))  # two full blocks
    a = Request(prompt)
    assert compute_whole_prompt(bm, a) == 8 and table(bm, a) == [0, 1]
    bm.free(a)  # tail first, both cached: to the back
    assert free() == [2, 3, 4, 5, 1, 0]

    b = Request(prompt)
    # Block 0 hits; the second block is recomputed into the front block, 2.
    assert compute_whole_prompt(bm, b) == 4
    assert table(bm, b) == [0, 2] and bm.num_cached_blocks == 3  # block 2 is a second copy of block 1's hash
    bm.free(b)
    # 2 (cached copy) then 0 (cached) to the back: vLLM's order. A duplicate left unhashed would go to the front.
    assert free() == [3, 4, 5, 1, 2, 0]
    # While both copies live, a lookup takes the first one cached.
    assert hit_table(bm, Request(prompt + [10])) == [0, 1]

    # Unrelated content takes four blocks from the front: 3, 4, 5 and 1, evicting the original copy.
    c = Request([9] * 13)
    assert compute_whole_prompt(bm, c) == 13 and table(bm, c) == [3, 4, 5, 1]
    # The duplicate still serves the prompt: a longer request hits both of its blocks.
    d = Request(prompt + [10])
    assert hit_table(bm, d) == [0, 2]
    bm.free(c)
    assert compute_whole_prompt(bm, d) == 1 and bm.prefix_cache_stats.hits == 4 + 8


def test_evicting_one_copy_keeps_the_hash_cached_until_the_last_copy_goes():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    first, second = Request([5, 6, 7]), Request([5, 6, 7])
    assert compute_whole_prompt(bm, first) == 3  # blocks 0 (full, cached) and 1
    # A second request admitted while the first still runs hits block 0: no duplicate from a hit.
    assert compute_whole_prompt(bm, second) == 1 and table(bm, second) == [0, 2]
    bm.free(second)
    bm.free(first)
    assert bm.num_cached_blocks == 1
    # Two prompts that fill the same block in two running requests publish two copies of one hash.
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    x, y = Request([5, 6]), Request([5, 6])
    assert admit(bm, x, 1) == 1 and admit(bm, y, 1) == 1  # neither block is full yet: no hit possible
    x.num_computed_tokens = y.num_computed_tokens = 1
    assert bm.allocate_slots(x, 1) and bm.allocate_slots(y, 1)  # both blocks fill: two copies
    assert bm.num_cached_blocks == 2 and len(bm.block_pool.cached_block_hash_to_block) == 1
    bm.free(x)
    bm.free(y)
    # Evict one copy (the least recently freed, x's block 0), then the other: the hash is gone only then.
    pool = bm.block_pool
    assert pool.get_new_blocks(2) == [2, 3]
    assert bm.num_cached_blocks == 2 and pool.num_evictions == 0  # blocks 2 and 3 were never used
    assert pool.get_new_blocks(1) == [0] and bm.num_cached_blocks == 1 and pool.num_evictions == 1
    assert hit_table(bm, Request([5, 6, 1])) == [1]
    assert (
        pool.get_new_blocks(1) == [1] and bm.num_cached_blocks == 0 and pool.cached_block_hash_to_block == {}
    )
    assert pool.num_evictions == 2


# --- Sliding-window admission cap --------------------------------------------------------------------------------


def test_admission_cap_is_the_window_plus_the_tokens_in_flight():
    # cdiv(32 - 1 + 32, 16) + 1 = 5 blocks, however long the prompt; capped by max_model_len below the window.
    assert max_admission_blocks(32, 16, 32) == 5
    assert max_admission_blocks(32, 16, 32, num_tokens=20) == 2 + 1
    sliding = BlockManager(8, 16, windows=[32], max_in_flight_tokens=32, max_model_len=4096)
    full = BlockManager(8, 16, windows=[None], max_in_flight_tokens=32, max_model_len=4096)
    prompt = Request(list(range(300)))
    miss = ComputedBlocks([[]], 0)
    # The first chunk alone needs 2 blocks; the whole prompt 19, which a sliding group caps at 5.
    assert sliding.get_num_blocks_to_admit(miss, 32) == 2 == full.get_num_blocks_to_admit(miss, 32)
    assert sliding.get_num_blocks_to_admit(miss, 32, reserve_tokens=prompt.num_tokens) == 5
    assert full.get_num_blocks_to_admit(miss, 32, reserve_tokens=prompt.num_tokens) == 19


@pytest.mark.parametrize("reserve_full_isl", [False, True])
def test_a_long_prompt_on_a_sliding_model_is_admitted_with_the_whole_prompt_reserved(reserve_full_isl):
    """Issue 21's case: Mistral-like, window 32, 8 blocks of 16, chunks of 32, a 300-token prompt. With the whole
    prompt reserved, vLLM admits it at 5 blocks (the cap); it runs within the window's 5 blocks and finishes."""
    model = tiny_model("mistral", window=32, **KNOBS)
    engine = LLMEngine(
        model,
        block_size=16,
        num_blocks=8,
        max_num_batched_tokens=32,
        scheduler_reserve_full_isl=reserve_full_isl,
    )
    prompt = torch.randint(2, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    peak = 0
    for _ in range(50):
        if seq.is_finished:
            break
        engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    assert seq.is_finished and len(seq.output_token_ids) == 4
    assert peak <= 5 and engine.scheduler.num_preemptions == 0


# --- Sliding-window prefix-cache retention ----------------------------------------------------------------------


def cached_block_indices(bm: BlockManager, seq: Request) -> list[int]:
    """Which of `seq`'s blocks in group 0 carry a published hash."""
    return [
        i for i, b in enumerate(table(bm, seq)) if b != NULL_BLOCK and bm.block_pool.block_keys[b] is not None
    ]


@pytest.mark.parametrize(
    ("interval", "kept", "sibling_hit"),
    [
        # Window 8, blocks of 4: a hit needs cdiv(7, 4) = 2 blocks before it. The prompt's last token is 39, so a
        # resend resumes at block 9 and needs blocks 7 and 8: vLLM's default keeps only those.
        (0, [7, 8], 0),
        # An interval of 16 tokens (4 blocks) also keeps the last 2 blocks of each interval: 2, 3, 6, 7.
        (16, [2, 3, 6, 7, 8], 16),
        # None: every full block (10 of them), so any shared prefix hits.
        (None, list(range(10)), 24),
    ],
)
def test_sliding_group_keeps_only_the_blocks_a_hit_can_reach(interval, kept, sibling_hit):
    bm = BlockManager(
        32, 4, enable_prefix_caching=True, windows=[8], prefix_cache_retention_interval=interval
    )
    prompt = list(range(10, 50))  # 40 tokens: 10 full blocks
    first = Request(prompt)
    assert compute_whole_prompt(bm, first) == 40
    # Blocks behind the window are freed only at the next step, so the whole table is still here to inspect.
    assert cached_block_indices(bm, first) == kept
    bm.free(first)
    # A resend hits up to block 9 (36 tokens) whatever the interval: that point is always kept.
    assert len(hit_table(bm, Request(prompt))) == 9
    # A sibling sharing the first 24 tokens, then different: its hit needs blocks 4 and 5 (or an earlier pair).
    sibling = Request(prompt[:24] + [99] * 16)
    assert len(hit_table(bm, sibling)) * 4 == sibling_hit


def test_a_shared_prefix_junction_is_kept_for_the_next_request():
    """Hybrid (full + sliding): a request whose full-attention hit is longer than the sliding group's keeps its
    sliding window at that junction (vLLM's `shared_prefix_boundary`), so the next sibling hits the prefix."""
    bm = BlockManager(64, 4, enable_prefix_caching=True, windows=[None, 8])
    prompt = list(range(10, 50))
    first = Request(prompt)
    compute_whole_prompt(bm, first)
    bm.free(first)
    second = Request(prompt[:24] + [99] * 16)
    # Full attention could serve 6 blocks; the sliding group kept none of blocks 4 and 5, so nothing hits.
    assert compute_whole_prompt(bm, second) == 40 and second.shared_prefix_boundary == 24
    sliding_table = table(bm, second, group=1)
    assert [i for i, b in enumerate(sliding_table) if bm.block_pool.block_keys[b] is not None] == [
        4,
        5,
        7,
        8,
    ]
    bm.free(second)
    third = Request(prompt[:24] + [77] * 8)
    assert compute_whole_prompt(bm, third) == 32 - 24 and third.shared_prefix_boundary == 0


def test_retention_knob_defaults_to_vllms_and_rejects_what_vllm_rejects():
    assert (
        EngineConfig().prefix_cache_retention_interval == vllm_defaults.PREFIX_CACHE_RETENTION_INTERVAL == 0
    )
    assert VLLM_DEFAULTS["prefix_cache_retention_interval"] == "0 (vllm/config/cache.py)"
    for bad in (-16, 8, True, 1.5):
        with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
            EngineConfig(block_size=16, prefix_cache_retention_interval=bad)
    with pytest.raises(ValueError, match="sliding-window"):
        BlockManager(8, 4, windows=[None], prefix_cache_retention_interval=16)
    BlockManager(8, 4, windows=[None], prefix_cache_retention_interval=None)  # dense: accepted, as in vLLM


# --- A scheduler that cannot progress says so ------------------------------------------------------------------


def test_a_request_an_idle_pool_cannot_admit_raises_one_line_at_once():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, BlockManager(num_blocks=2, block_size=4))
    scheduler.add(Request(list(range(2, 22)), request_id="long"))
    with pytest.raises(SchedulerStalled) as err:
        scheduler.schedule(0.0)
    message = str(err.value)
    assert "\n" not in message
    assert "request long of 20 tokens can never be admitted" in message and "needs 5 free blocks" in message


class NeverGrows(BlockManager):
    """A pool that admits a request's first chunk but never gives it a block more: a livelock of preemption."""

    def allocate_slots(
        self, request, num_new_tokens, num_computed_tokens=None, new_computed_blocks=None, reserve_tokens=0
    ):
        admitting = new_computed_blocks is not None
        return (admitting or request.num_computed_tokens == 0) and super().allocate_slots(
            request, num_new_tokens, num_computed_tokens, new_computed_blocks, reserve_tokens
        )


def test_a_schedule_that_never_progresses_raises_within_the_idle_bound():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=64)
    scheduler = Scheduler(config, NeverGrows(num_blocks=32, block_size=4))
    scheduler.add(Request(list(range(2, 22))))
    steps = 0
    with pytest.raises(SchedulerStalled, match=r"no progress in \d+ steps \(bound 20\)"):
        while steps < 1000:
            steps += 1
            batch = scheduler.schedule(0.0)
            if batch.seqs:
                scheduler.update_from_output(batch, RunnerOutput([], [], []), 0.0)
    # Bound: 2 sequences + cdiv(64, 4) chunks + 2 = 20 idle steps; the first step progressed.
    assert config.max_idle_steps == 20 and steps == 1 + 20 + 1
    # Steps 2, 4, ..., 22 each preempted the sequence the step before had re-admitted.
    assert scheduler.num_preemptions == 11


# --- The provenance table ----------------------------------------------------------------------------------------


def test_the_fidelity_table_names_code_and_tests_that_exist():
    """docs/vllm-fidelity.md holds the vLLM file and version of each rule; every kvlab name it gives imports and
    every test it names exists, so the table cannot drift from the code."""
    import importlib
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "vllm-fidelity.md").read_text()
    assert "vLLM 0.33.0" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| rule")]
    assert len(rows) >= 15
    for row in rows:
        _, vllm, kvlab, test = (cell.strip() for cell in row.strip("|").split(" | "))
        assert "vllm/" in vllm, row
        (name,) = re.findall(r"`(kvlab\.[\w.]+)`", kvlab)
        parts = name.split(".")
        for cut in range(len(parts), 1, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break
        else:
            raise AssertionError(f"{name} does not import")
        (test_ref,) = re.findall(r"`(test_\w+\.py)::(\w+)`", test)
        assert f"def {test_ref[1]}(" in (root / "tests" / test_ref[0]).read_text(), row
