"""kvlab.planning.fast_engine: the simulator's shortcuts take the engine's own decisions, to the bit."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.costs.workloads import synthetic_trace
from kvlab.engine import LLMEngine
from kvlab.engine.clock import VirtualClock
from kvlab.engine.cost_runner import CostRunner
from kvlab.engine.request import Request
from kvlab.planning import simulate as sim
from kvlab.planning.fast_engine import FastBlockManager, FastEngine, PlaceholderRunner

COST = sim.LinearStepCost(2e-3, 5e-5, 1e-6, 1e-4, 3e-4)


def replay(engine_cls, runner_cls, requests, **knobs):
    runner = runner_cls(COST, knobs.pop("num_blocks"))
    engine = engine_cls(runner=runner, clock=VirtualClock(), **knobs)
    outputs = engine.replay(requests)
    return (
        [dataclasses.asdict(o.metrics) for o in outputs],
        [len(o.token_ids) for o in outputs],  # placeholder tokens differ: they follow the request ids
        engine.step_stats,
        runner.step_seconds,
        engine.scheduler.num_preemptions,
        engine.block_manager.prefix_cache_stats,
        engine.block_manager.block_pool.num_evictions,
    )


@pytest.mark.parametrize(
    "knobs",
    [
        dict(num_blocks=24, block_size=8, max_num_seqs=16, max_num_batched_tokens=64),
        dict(
            num_blocks=40,
            block_size=8,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            enable_prefix_caching=False,
        ),
        dict(num_blocks=200, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, scheduling="static"),
        dict(num_blocks=60, block_size=16, max_num_batched_tokens=48, scheduler_reserve_full_isl=True),
    ],
)
def test_fast_engine_equals_the_general_engine(knobs):
    """Preempting, chunking, prefix-sharing runs: every metric, token, step and counter is the same."""
    requests = synthetic_trace(
        40, "sharegpt", request_rate=60.0, scale=0.1, seed=4, max_input_len=60, max_output_len=30,
        shared_prefix_len=24, shared_prefix_fraction=0.5,
    )  # fmt: skip
    general = replay(LLMEngine, CostRunner, requests, **knobs)
    fast = replay(FastEngine, PlaceholderRunner, requests, **knobs)
    assert fast == general
    if knobs["num_blocks"] == 24:
        assert general[4] > 0, "the small pool preempts"


@pytest.mark.parametrize("caching", [False, True])
def test_slot_limit_marks_the_steps_that_need_no_block_work(caching):
    bm = FastBlockManager(8, 16, enable_prefix_caching=caching)
    seq = Request(list(range(2, 42)))  # 40 tokens, of which a first chunk of 20 computes
    hit = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, 20, 0, hit)
    # Without caching, the two blocks' 32 slots; with it, the step that fills block 1 must publish it.
    assert bm.slot_limit[seq.request_id] == (31 if caching else 32)
    seq.num_computed_tokens = 20
    free = bm.num_free_blocks
    assert bm.allocate_slots(seq, 11) and bm.num_free_blocks == free
    assert bm.num_cached_blocks == caching
    seq.num_computed_tokens = 31
    assert bm.allocate_slots(seq, 2) and bm.num_free_blocks == free - 1
    assert bm.slot_limit[seq.request_id] == (47 if caching else 48)
    # Block 1 (tokens 16..31) filled at that step: with caching it is published now.
    assert bm.num_cached_blocks == 2 * caching
    bm.free(seq)
    assert seq.request_id not in bm.slot_limit


def test_the_simulator_runs_on_the_fast_engine(monkeypatch):
    seen = []
    original = FastEngine.step

    def step(self):
        seen.append(type(self.runner))
        return original(self)

    monkeypatch.setattr(FastEngine, "step", step)
    sim.simulate([sim.TraceRequest(0.0, (2, 3, 4), 2)], COST, num_blocks=8, block_size=4)
    assert seen and set(seen) == {PlaceholderRunner}
