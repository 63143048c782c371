"""kvlab.planning.simulate: the scheduler and block manager on a virtual clock, validated against the real engine."""

import dataclasses
import hashlib
import json
import math

import numpy as np
import pytest

from kvlab.costs.workloads import synthetic_trace
from kvlab.engine import LLMEngine
from kvlab.engine.clock import VirtualClock
from kvlab.engine.config import EngineConfig
from kvlab.engine.cost_runner import CostRunner
from kvlab.engine.request import SamplingParams
from kvlab.models import tiny_model
from kvlab.planning import simulate as sim

KNOBS = dict(
    num_blocks=48, block_size=8, max_num_seqs=16, max_num_batched_tokens=64, enable_prefix_caching=False
)
SIM_KNOBS = {k: v for k, v in KNOBS.items()}


def trace(n, rate, seed):
    return synthetic_trace(
        n, "sharegpt", request_rate=rate, scale=0.1, seed=seed, max_input_len=60, max_output_len=40
    )


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, device="cpu")


def test_simulator_equals_engine_on_a_virtual_clock(model):
    """One step loop on two runners: with the engine's own virtual-clock cost, the model runner and the cost
    runner give the same token times and the same step statistics, to the bit."""
    clock = VirtualClock()
    requests = trace(30, 40.0, seed=3)
    engine = LLMEngine(model, clock=clock, **KNOBS)
    outputs = engine.replay(requests)
    result = sim.simulate(requests, lambda new, ctx: clock.step_seconds(sum(new), sum(ctx)), **SIM_KNOBS)
    # The pool is small enough to preempt.
    assert result.num_preemptions == engine.scheduler.num_preemptions > 0
    assert result.step_stats == engine.step_stats
    for out, metrics in zip(outputs, result.requests, strict=True):
        assert metrics.token_times == out.metrics.token_times
        assert metrics.first_token_time == out.metrics.first_token_time


def _digest(result: sim.SimulationResult) -> str:
    fields = dict(
        requests=[dataclasses.asdict(m) for m in result.requests],
        stats=[dataclasses.asdict(s) for s in result.step_stats],
        pre=result.num_preemptions,
        peak=result.peak_blocks_used,
        secs=result.step_seconds,
        queued=result.queued,
        mru=result.mean_running_unrecorded,
    )
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


SMALL_POOL = dict(num_blocks=48, block_size=8, max_num_seqs=16, max_num_batched_tokens=64)


@pytest.mark.parametrize(
    "knobs, seed, digest",
    [
        (SMALL_POOL, 1, "d9d203b1c363a7d2"),
        (SMALL_POOL | dict(concurrency=3), 1, "8498f884ed193051"),
        (SMALL_POOL | dict(scheduling="static"), 2, "75d2212d2886ff98"),
        (dict(num_blocks=400, block_size=16, concurrency=5, record_steps=False), 1, "fd1b757e71f2bbad"),
    ],
)
def test_simulation_results_are_pinned_to_the_bit(knobs, seed, digest):
    """Every metric, step statistic and step time of these runs as the simulator gave them before it became the
    engine on a cost runner (issue 20): a refactor that moves one float fails here."""
    cost = sim.LinearStepCost(2e-3, 5e-5, 1e-6, 1e-4, 3e-4)
    requests = synthetic_trace(
        30, "sharegpt", request_rate=40.0, scale=0.1, seed=seed, max_input_len=60, max_output_len=40
    )
    assert _digest(sim.simulate(requests, cost, **knobs)) == digest


def test_prefix_sharing_simulation_is_pinned_to_the_bit():
    requests = [sim.TraceRequest(0.01 * i, tuple([5] * 40 + [6 + i % 3] * 9), 7) for i in range(20)]
    cost = sim.LinearStepCost(2e-3, 5e-5, 1e-6, 1e-4, 3e-4)
    assert _digest(sim.simulate(requests, cost, num_blocks=30, block_size=8)) == "8596ff9574474eb7"


def test_simulator_is_the_engine_on_a_cost_runner():
    """No copy of the step loop: `simulate` drives `LLMEngine.step`, and a cost runner sees every batch."""
    runner = CostRunner(sim.LinearStepCost(1e-3, 1e-4), num_blocks=16)
    engine = LLMEngine(config=EngineConfig(block_size=4), runner=runner, clock=VirtualClock())
    seen = []
    engine.scheduler.on_step.append(lambda batch: seen.append(batch.num_batched_tokens))
    (out,) = engine.generate([[2, 3, 4, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and engine.pool is None
    assert seen == [5, 1, 1] and runner.step_seconds == pytest.approx([1.5e-3, 1.1e-3, 1.1e-3])
    assert engine.clock.now() == sum(runner.step_seconds)
    assert engine.max_model_len == 64, "with no model limit, the pool's 16 blocks of 4 tokens bound it"


def test_linear_cost_fit_recovers_constants():
    truth = sim.LinearStepCost(2e-3, 5e-5, 1e-6, 1e-4)
    records = [
        sim.StepRecord(t, c, s, truth([1] * (s - 1) + [t - s + 1], [c]))
        for t, c, s in [(1, 10, 1), (64, 300, 5), (16, 900, 16), (40, 100, 3), (8, 2000, 8), (64, 64, 1)]
    ]
    fit = sim.fit_linear_cost(records)
    for name in ("overhead_s", "per_token_s", "per_context_token_s", "per_seq_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)


@pytest.mark.parametrize(
    "bad",
    [[], [sim.TraceRequest(-1.0, (3, 4), 2)], [sim.TraceRequest(0.0, (3, 4), 0)]],
    ids=["empty", "negative-arrival", "no-output"],
)
def test_bad_workloads_are_refused(bad):
    with pytest.raises(ValueError, match="workload is empty|arrival|max_tokens"):
        sim.simulate(bad, sim.LinearStepCost(1e-3), num_blocks=8)


def test_prompt_larger_than_pool_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        sim.simulate([sim.TraceRequest(0.0, tuple(range(2, 200)), 2)], sim.LinearStepCost(1e-3), num_blocks=4)


def test_fit_recovers_constants_with_prefill_term_and_host_gap():
    truth = sim.LinearStepCost(2e-3, 5e-5, 1e-6, 1e-4, 3e-4)
    shapes = [
        (1, 10, 1, 0),
        (64, 300, 5, 2),
        (16, 900, 16, 0),
        (40, 100, 3, 1),
        (8, 2000, 8, 0),
        (64, 64, 1, 1),
    ]
    records = [sim.StepRecord(*f[:3], truth.of(*f), f[3], gap_s=1e-4) for f in shapes]
    fit = sim.fit_linear_cost(records)
    assert fit.overhead_s == pytest.approx(
        truth.overhead_s + 1e-4, rel=1e-6
    )  # the host gap joins the overhead
    for name in ("per_token_s", "per_context_token_s", "per_seq_s", "per_prefill_seq_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert truth([30, 1, 1], [30, 50, 70]) == pytest.approx(truth.of(32, 150, 3, 1))


def test_calibration_and_validation_refuse_bad_input(model):
    with pytest.raises(ValueError, match="at least 5 measured steps"):
        sim.fit_linear_cost([sim.StepRecord(1, 1, 1, 1e-3)])
    with pytest.raises(ValueError, match="finite and > 0"):
        sim.fit_linear_cost([sim.StepRecord(1, 1, 1, s) for s in (1e-3, 1e-3, 0.0, 1e-3, 1e-3)])
    with pytest.raises(ValueError, match="calibration traces"):
        sim.validate(model, [], {"x": trace(2, 1.0, 0)}, **KNOBS)
    with pytest.raises(ValueError, match="calibration trace"):
        sim.calibrate(model, [], **KNOBS)


def test_record_engine_steps_refuses_an_unknown_clock(model):
    with pytest.raises(ValueError, match="clock must be"):
        sim.record_engine_steps(model, trace(2, 1.0, 0), clock="gpu", **KNOBS)


def test_batch_corrected_cost_follows_a_step_in_the_decode_cost():
    # A CPU's decode step: flat for 1-3 sequences, a jump at 4 (the matmul kernel changes), plus a prefill step.
    base = sim.LinearStepCost(10e-3, per_seq_s=2e-3)
    truth = {1: 12e-3, 2: 13e-3, 3: 14e-3, 4: 24e-3}
    records = [sim.StepRecord(n, 10 * n, n, truth[n]) for n in truth for _ in range(3)]
    records += [sim.StepRecord(40, 40, 2, 0.05, num_prefill_seqs=2), sim.StepRecord(5, 50, 5, 0.03)]
    cost = sim.BatchCorrectedCost.from_records(base, records)
    assert set(cost.decode_factors) == {1, 2, 3, 4}  # a batch size seen once (5) is left uncorrected
    for n, seconds in truth.items():
        assert cost([1] * n, [10] * n) == pytest.approx(seconds)
    assert cost([1] * 5, [10] * 5) == pytest.approx(base.of(5, 50, 5))
    assert cost([30, 1], [30, 11]) == pytest.approx(base.of(31, 41, 2, 1))  # a prompt chunk: the linear cost
    assert cost.scaled(2.0).of(4, 40, 4) == pytest.approx(2 * truth[4])
    with pytest.raises(ValueError, match="positive"):
        sim.BatchCorrectedCost(base, {2: 0.0})


def test_recorded_runs_keep_tokens_and_top_ids(model):
    requests = trace(6, math.inf, seed=4)
    run = sim.record_engine_steps(model, requests, "cpu", logprobs=3, **KNOBS)
    outputs = LLMEngine(model, clock=VirtualClock(), **KNOBS).replay(requests, logprobs=3)
    assert run.token_ids == [o.token_ids for o in outputs]
    assert run.top_token_ids == [o.top_token_ids for o in outputs]
    assert sum(map(len, run.token_ids)) == sum(r.max_tokens for r in requests)


def _row(label, error):
    return sim.ValidationRow(label, {}, {}, dict.fromkeys(sim.VALIDATION_KEYS, error), np.ones(1))


def test_validation_checks_apply_each_percentile_band():
    checks = sim.validation_checks([_row("6/s", 0.2), _row("saturated", -0.2)])
    assert len(checks) == 2 * len(sim.VALIDATION_KEYS) and all(c.holds for c in checks)
    missed = {c.name for c in sim.validation_checks([_row("20/s", 0.4)]) if not c.holds}
    # 40 % is outside the P50 (30 %) and throughput (25 %) bands, inside the P99 band (50 %)
    assert missed == {"20/s median_ttft", "20/s median_itl", "20/s median_e2el", "20/s output_throughput"}
    assert sim.band_for("p99_itl_ms") == 0.5 and sim.band_for("output_throughput") == 0.25


def test_measure_schedulers_runs_both_schedulers_and_predicts_their_steps(model):
    from kvlab.experiments import wallclock

    knobs = dict(block_size=8, num_blocks=48, max_num_seqs=4)
    c = wallclock.measure_schedulers(model, trace(8, math.inf, 5), trace(8, math.inf, 6), logprobs=2, **knobs)
    for s in wallclock.SCHEDULERS:
        # every request arrives at 0: the schedule is the engine's, step for step
        assert len(c.measured[s].steps) == len(c.predicted[s].step_seconds)
        assert c.measured[s].num_preemptions == c.predicted[s].num_preemptions
        # the second run serves the same tokens in the same steps; the measurement is the mean of the two
        assert c.repeats[s].token_ids == c.measured[s].token_ids
        assert len(c.repeats[s].steps) == len(c.measured[s].steps)
        first, second = c.measured[s].summary(), c.repeats[s].summary()
        mean = c.summaries()[s][0]["output_throughput"]
        assert mean == (first["output_throughput"] + second["output_throughput"]) / 2
        assert c.ttfts_ms(s)[0] == 1e3 * (c.measured[s].requests[0].ttft + c.repeats[s].requests[0].ttft) / 2
        assert set(c.errors()[s]) == set(wallclock.PREDICTED_KEYS)
    # the calibration trace ran under both schedulers, so its decode steps cover every batch size
    assert set(c.cost.decode_factors) == {1, 2, 3, 4}
    low, high = c.itl_band_ms()
    assert 0 < low < high
    checks = wallclock.check_schedulers(c, 0.4)
    assert len(checks) == 3 + 2 * len(wallclock.PREDICTED_KEYS) + 2
    assert len({check.name for check in checks}) == len(checks)


def test_simulate_at_rates_is_one_simulation_per_rate():
    cost = sim.LinearStepCost(1e-3, 1e-5)
    knobs = dict(num_blocks=64, block_size=8, record_steps=False)
    sweep = sim.simulate_at_rates(lambda r: trace(12, r, seed=1), [2.0, 50.0], cost, **knobs)
    assert sweep == [sim.simulate(trace(12, r, seed=1), cost, **knobs).summary() for r in (2.0, 50.0)]
    assert sweep[0]["p99_ttft_ms"] < sweep[1]["p99_ttft_ms"]


def test_load_curve_is_one_row_per_rate_of_the_keys_asked_for():
    cost = sim.LinearStepCost(1e-3, 1e-5)
    knobs = dict(num_blocks=64, block_size=8, record_steps=False)
    keys = ("p99_ttft_ms", "num_preemptions")
    curve = sim.load_curve(lambda r: trace(12, r, seed=1), [2.0, 50.0], cost, keys, **knobs)
    sweep = sim.simulate_at_rates(lambda r: trace(12, r, seed=1), [2.0, 50.0], cost, **knobs)
    assert curve.shape == (2, 3)
    assert curve.tolist() == [
        [r, out["p99_ttft_ms"], out["num_preemptions"]] for r, out in zip((2.0, 50.0), sweep, strict=True)
    ]


def test_progress_counts_every_finished_request_and_is_silent_off_a_terminal(monkeypatch, capsys):
    cost = sim.LinearStepCost(1e-3, 1e-5)
    knobs = dict(num_blocks=64, block_size=8, record_steps=False)
    quiet = sim.simulate(trace(12, 5.0, seed=1), cost, **knobs)
    shown = sim.simulate(trace(12, 5.0, seed=1), cost, progress="simulating", **knobs)
    assert shown.summary() == quiet.summary()
    assert capsys.readouterr().err == ""

    class Bar:
        n = 0
        closed = False

        def update(self):
            self.n += 1

        def close(self):
            self.closed = True

    bar = Bar()
    monkeypatch.setattr(sim, "_progress_bar", lambda label, total: bar)
    sim.simulate(trace(12, 5.0, seed=1), cost, progress="simulating", **knobs)
    assert bar.n == 12 and bar.closed
