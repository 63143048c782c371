"""kvlab.experiments.timing's measured claims (chapters 3 and 4) and kvlab.experiments.decode's (chapter 1): what each sweep measures,
and what each check decides on numbers chosen by hand (no timing decides a test here)."""

import math
from dataclasses import replace

import pytest
import torch
from test_step_overhead import FAKE_DEVICE

from kvlab import claims
from kvlab.costs import roofline
from kvlab.costs.roofline import StepEstimate
from kvlab.experiments import decode, timing
from kvlab.models import tiny_config, tiny_model

# The same round-figure device the overhead tests use: predictions below are exact arithmetic.
FAKE = FAKE_DEVICE
CONFIG = tiny_config("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)


def row(batch, context, measured_s, predicted_s, overhead_s, bound="memory"):
    """A comparison whose fastest step took `measured_s` against `predicted_s` (overhead included)."""
    work = predicted_s - overhead_s
    compute, memory = (work, work / 2) if bound == "compute" else (work / 2, work)
    step = StepEstimate(compute, memory, 1.0, 1.0, 1.0, 0.0, batch)
    return timing.DecodeComparison(
        timing.StepTiming(batch, context, (measured_s, 2 * measured_s)), step, predicted_s, overhead_s
    )


def sweep(rows, overhead_s, on_cpu=True, hw=FAKE, read_cost=None):
    """A sweep of `rows`; by default this device's matmul reads the weights as fast at every batch as at one."""
    overhead = timing.StepOverhead(timing.StepTiming(1, 1, (overhead_s,)), 2, 0.0)
    costs = read_cost or {r.measured.batch_size: 1.0 for r in rows}
    # one round: each point paired with the sweep's own ceilings
    return timing.DecodeSweep(hw, overhead, tuple(rows), CONFIG, torch.float32, on_cpu, costs, (tuple(rows),))


def failed(checks):
    return [c.name for c in checks if not c.holds]


def test_the_floor_allows_reads_half_again_faster_and_the_overhead_paid_in_full_on_a_cpu():
    # 9 ms of work and 1 ms of overhead: at best 6 + 1 ms on a CPU (serial), max(6, 1) ms on a GPU (overlapped)
    r = row(1, 16, 8e-3, 10e-3, 1e-3)
    assert timing.prediction_floor(r, on_cpu=True) == pytest.approx(0.7)
    assert timing.prediction_floor(r, on_cpu=False) == pytest.approx(0.6)
    # launch-bound on a GPU: the overhead alone
    assert timing.prediction_floor(row(1, 16, 1e-3, 1.3e-3, 1e-3), on_cpu=False) == pytest.approx(1 / 1.3)
    # the floor never goes below 2/3 on a CPU: at most the bytes move faster
    assert timing.prediction_floor(row(1, 16, 1, 1.0, 1e-12), on_cpu=True) == pytest.approx(2 / 3)
    band = timing.prediction_band(r, True, 2)
    assert band.holds and band.name == "batch 1, context 16: measured/predicted"
    assert not timing.prediction_band(row(1, 16, 6.9e-3, 10e-3, 1e-3), True, 2).holds
    assert not timing.prediction_band(row(1, 16, 20.1e-3, 10e-3, 1e-3), True, 2).holds


def test_a_launch_bound_gpu_floor_allows_the_hollow_steps_spread():
    """On a GPU at sizes where launches set the time, the model's fastest step is one more sample of the hollow
    twin's: it may come in under the hollow twin's fastest by their spread, not by more (a clock that misses
    the kernels)."""
    spread = dict(overhead_spread_s=0.05e-3)
    # 1 ms of launches (the hollow steps 1.00-1.10 ms, median 1.05), 0.01 ms of work: predicted 1.01 ms
    drew_faster = replace(row(1, 16, 0.98e-3, 1.01e-3, 1e-3), **spread)
    assert not timing.prediction_band(row(1, 16, 0.98e-3, 1.01e-3, 1e-3), False, 2).holds, "the coin flip"
    assert timing.prediction_band(drew_faster, False, 2).holds
    assert timing.prediction_floor(drew_faster, on_cpu=False) == pytest.approx(0.95 / 1.01)
    missed_the_kernels = replace(row(1, 16, 0.1e-3, 1.01e-3, 1e-3), **spread)
    assert not timing.prediction_band(missed_the_kernels, False, 2).holds
    # where the work sets the time the spread changes nothing, and a CPU keeps the overhead whole
    worked = replace(row(1, 16, 8e-3, 10e-3, 1e-3), **spread)
    assert timing.prediction_floor(worked, on_cpu=False) == pytest.approx(0.6)
    assert timing.prediction_floor(worked, on_cpu=True) == pytest.approx(0.7)
    # the spread is the hollow steps' median less their fastest
    hollow = timing.StepOverhead(timing.StepTiming(1, 1, (1.10e-3, 1.00e-3, 1.05e-3)), 2, 0.0)
    assert hollow.spread_s == pytest.approx(0.05e-3)


def rescaled(r, factor, overhead_s):
    """`r` predicted with its work (the bandwidth's share) scaled by `factor`, as a bandwidth 1/factor wrong."""
    work = factor * (r.prediction_s - overhead_s)
    return row(r.measured.batch_size, r.measured.tokens, r.measured.best_s, overhead_s + work, overhead_s)


def test_the_work_band_rejects_a_bandwidth_two_times_wrong_either_way():
    # a small model's steps, mostly overhead: work ratios 1.2, 1.5, 1.45, 1.9 (one context slowed by a burst)
    o = 2.5e-3
    rows = [
        row(1, c, o + w * 2e-3, o + 2e-3, o) for c, w in [(16, 1.2), (256, 1.5), (1024, 1.45), (4096, 1.9)]
    ]
    assert [timing.work_ratio(r) for r in rows] == pytest.approx([1.2, 1.5, 1.45, 1.9])
    band = timing.work_band(rows, on_cpu=True)
    assert band.holds and band.detail.startswith("1.475 in ["), band.detail
    # the bandwidth 2x too high: every work predicted in half the time, the median ratio doubles
    fast = timing.work_band([rescaled(r, 0.5, o) for r in rows], on_cpu=True)
    assert not fast.holds and fast.detail.startswith("2.95 in"), fast.detail
    # 2x too low: the median halves, below the band, though the slowest context alone would pass
    slow = timing.work_band([rescaled(r, 2, o) for r in rows], on_cpu=True)
    assert not slow.holds and slow.detail.startswith("0.7375 in"), slow.detail
    # a lab may pass a band of its own
    assert timing.work_band(rows, on_cpu=True, band=(0.9, 1.75)).holds
    # a band 2x wide or wider would let a true prediction and one 2x wrong both hold: refused
    with pytest.raises(ValueError, match="work band"):
        timing.work_band(rows, on_cpu=True, band=(0.8, 1.6))
    low, high = timing.WORK_BAND
    assert high / low < 2


def test_the_work_band_counts_only_work_bound_steps_on_a_gpu():
    launches = [row(1, c, 1.02e-3, 1.01e-3, 1e-3) for c in (16, 64)]
    skipped = timing.work_band(launches, on_cpu=False)
    assert skipped.holds and skipped.detail.startswith("not checked"), skipped.detail
    # on a CPU the same rows count, and their work (0.02 ms against 0.01 ms predicted) is twice too slow
    assert not timing.work_band(launches, on_cpu=True).holds
    # a work-bound GPU step enters the median, the launch-bound ones do not
    worked = row(1, 4096, 21e-3, 21e-3, 1e-3)
    assert timing.work_band(launches + [worked], on_cpu=False).detail.startswith("1 in")


def test_probe_bytes_follow_the_weights_within_limits():
    model = tiny_model(config=CONFIG, device="cpu")
    assert timing.probe_bytes(model) == 2**20  # a tiny model: the 1 MiB minimum
    assert timing.probe_bytes(model, cap=2**20) == 2**20
    big = tiny_model("llama", layers=2, hidden=512, heads=8, vocab=1024, device="cpu")
    assert 2**20 < timing.probe_bytes(big) <= 256 * 2**20 and timing.probe_bytes(big) % 4 == 0


def test_decode_points_are_unique_and_ordered():
    assert timing.decode_points([16, 64], [1, 4], 16) == [(1, 16), (1, 64), (4, 16)]


def test_a_sweep_measures_everything_in_rounds():
    model = tiny_model(config=CONFIG, device="cpu")
    s = timing.sweep_decode(model, [(1, 8), (2, 8)], repeat=2, rounds=3, warmup=1, hw_repeat=1)
    assert [(r.measured.batch_size, r.measured.tokens) for r in s.rows] == [(1, 8), (2, 8)]
    assert all(len(r.measured.seconds) == 6 for r in s.rows) and len(s.overhead.timing.seconds) == 6
    assert s.on_cpu and s.hw.copy_bytes == 2**20
    # the linear maps at every measured batch, against batch 1; on a CPU their read rate, not the copy's, is the
    # bandwidth
    assert set(s.read_cost) == {1, 2} and s.read_cost[1] == 1.0 and s.read_cost[2] > 0
    assert (
        s.hw.weight_read_bytes_per_s is not None
        and s.hw.weight_read_bytes_per_s != s.hw.bandwidth_bytes_per_s
    )
    assert (
        timing.linear_shapes(model)[:2] == [(64, 64), (32, 64)]
        and len(timing.linear_shapes(model)) == 2 * 7 + 1
    )
    for r in s.rows:
        # the bench's realistic prediction, with the overhead this sweep measured
        expected = timing.predict_bench_step(r.predicted, s.hw, torch.float32, s.overhead.realism())
        assert r.prediction_s == expected and r.overhead_s == s.overhead.step_s
    assert s.row(2, 8) is s.rows[1] and s.at_batches([1, 2], 8) == list(s.rows)
    with pytest.raises(KeyError, match="no measured point"):
        s.row(3, 8)
    # each round apart: its own steps of every point, against that round's ceilings and hollow steps
    assert len(s.round_rows) == 3
    paired = s.paired_rows([8])
    assert [p.measured.seconds for p in paired] == [s.rows[0].measured.seconds[k : k + 2] for k in (0, 2, 4)]
    hollow = s.overhead.timing.seconds
    bound = s.overhead.bound_s
    assert [p.overhead_s for p in paired] == [max(min(hollow[k : k + 2]) - bound, 0) for k in (0, 2, 4)]
    # a round's ceilings are no faster than the fastest of the whole sweep
    assert all(p.predicted.memory_s >= s.rows[0].predicted.memory_s for p in paired)
    assert s.paired_rows([8], batch_size=2)[0] is s.round_rows[0][1]


def test_context_growth_checks():
    contexts, batches = [16, 256, 4096], [1, 64]
    good = [
        row(1, 16, 4e-3, 4e-3, 2.7e-3),
        row(1, 256, 5e-3, 4.5e-3, 2.7e-3),
        row(1, 4096, 17e-3, 15e-3, 2.7e-3),
        row(1, 128, 4e-3, 4e-3, 2.7e-3),
        row(64, 128, 40e-3, 20e-3, 2.7e-3),
    ]
    kw = dict(min_predicted_growth=1.5, ratio_high=2)
    # batch 64 costs 10 batch-1 steps; this device's 64-row matmul costs 4 matrix-vector products: below
    # sqrt(64 * 4) = 16
    kernel = {1: 1.0, 64: 4.0}
    checks = timing.check_context_growth(sweep(good, 2.7e-3, read_cost=kernel), contexts, batches, 128, **kw)
    assert failed(checks) == []
    # reads shared perfectly by the kernel: the same batch is dearer than sqrt(64) = 8
    assert failed(timing.check_context_growth(sweep(good, 2.7e-3), contexts, batches, 128, **kw)) == [
        "batch 64 in batch-1 steps"
    ]
    names = [c.name for c in checks]
    assert "the CPU sizes show the growth" in names and "the step grows with the context" in names
    # a prediction doubled: every step far faster than predicted
    doubled = [
        row(r.measured.batch_size, r.measured.tokens, r.measured.best_s, 2 * r.prediction_s, 2.7e-3)
        for r in good
    ]
    assert "batch 1, context 16: measured/predicted" in failed(
        timing.check_context_growth(sweep(doubled, 2.7e-3), contexts, batches, 128, **kw)
    )
    # a step that does not grow, and a batch that costs as much as its sequences
    flat = good[:2] + [row(1, 4096, 8e-3, 15e-3, 2.7e-3), good[3], row(64, 128, 40 * 4e-3, 20e-3, 2.7e-3)]
    missed = failed(
        timing.check_context_growth(sweep(flat, 2.7e-3, read_cost=kernel), contexts, batches, 128, **kw)
    )
    assert "the step grows with the context" in missed and "batch 64 in batch-1 steps" in missed
    # launch-bound sizes on a GPU: no growth to show, and none required
    gpu = timing.check_context_growth(
        sweep(good[:1] * 3 + good[3:], 2.7e-3, on_cpu=False, read_cost=kernel),
        [16, 16, 16],
        batches,
        128,
        **kw,
    )
    assert "the CPU sizes show the growth" not in [c.name for c in gpu]
    assert "the CPU sizes show the growth" in failed(
        timing.check_context_growth(
            sweep(good[:1] * 3 + good[3:], 2.7e-3, read_cost=kernel), [16, 16, 16], batches, 128, **kw
        )
    )


def test_roofline_checks():
    contexts, batches = [16, 64], [1, 4, 16]
    o = 3e-3
    rows = [
        row(1, 16, 32e-3, 35e-3, o),
        row(1, 64, 33e-3, 36e-3, o),
        row(4, 16, 40e-3, 36e-3, o),
        row(16, 16, 90e-3, 50e-3, o, bound="compute"),
    ]
    kw = dict(dominance=3, ratio_high=2)
    # CONFIG on FAKE turns compute-bound at about 9.3 sequences: batch 4 is the largest measured below it
    assert roofline.critical_batch_size(CONFIG, FAKE, 16, dtype=torch.float32) == pytest.approx(9.3, abs=0.1)
    checks = timing.check_roofline(sweep(rows, o), contexts, batches, 16, **kw)
    assert failed(checks) == []
    names = [c.name for c in checks]
    assert {
        "context 16: memory-bound on the roofline",
        "a batch-1 step with work >= 3x the overhead",
        "a measured batch below the critical batch",
        "batch 4 in batch-1 steps",
        "batch 16, context 16: measured/predicted",
    } <= set(names)
    # the bandwidth halved: every prediction about twice as long, measured far below the floor
    halved = [
        row(r.measured.batch_size, r.measured.tokens, r.measured.best_s, 2 * r.prediction_s - o, o)
        for r in rows
    ]
    missed = failed(timing.check_roofline(sweep(halved, o), contexts, batches, 16, **kw))
    assert "batch 1, context 16: measured/predicted" in missed
    # batching that costs as much as its sequences
    dear = rows[:2] + [row(4, 16, 4 * 30e-3, 36e-3, o), rows[3]]
    assert failed(timing.check_roofline(sweep(dear, o), contexts, batches, 16, **kw)) == [
        "batch 4 in batch-1 steps"
    ]
    # a device whose 4-row matmul costs 1.8 matrix-vector products: batch 4 may cost up to sqrt(4 * 1.8)
    slow_kernel = {1: 1.0, 4: 1.8, 16: 3.0}
    costly = rows[:2] + [row(4, 16, 2.5 * 30e-3, 36e-3, o), rows[3]]
    assert (
        failed(timing.check_roofline(sweep(costly, o, read_cost=slow_kernel), contexts, batches, 16, **kw))
        == []
    )
    assert "batch 4 in batch-1 steps" in failed(
        timing.check_roofline(sweep(costly, o), contexts, batches, 16, **kw)
    )
    assert "batch 4 in batch-1 steps" in failed(
        timing.check_roofline(sweep(dear, o, read_cost=slow_kernel), contexts, batches, 16, **kw)
    )
    # launch-bound everywhere: on a CPU that is a failure (CI would never check the claim), on a GPU it is not
    tiny = [row(r.measured.batch_size, r.measured.tokens, 4e-3, 4e-3, o) for r in rows]
    rule = "a batch-1 step with work >= 3x the overhead"
    assert rule in failed(timing.check_roofline(sweep(tiny, o), contexts, batches, 16, **kw))
    on_gpu = timing.check_roofline(sweep(tiny, o, on_cpu=False), contexts, batches, 16, **kw)
    assert rule not in [c.name for c in on_gpu]


def test_batch_cost_sits_at_the_geometric_midpoint_of_shared_and_unshared_reads():
    o = 3e-3
    rows = [row(1, 16, 30e-3, 35e-3, o), row(4, 16, 59e-3, 36e-3, o), row(16, 16, 130e-3, 50e-3, o)]
    # reads shared perfectly by the device's matmul: the midpoint of 1 and 4 is 2, of 1 and 16 is 4
    check = timing.batch_cost(sweep(rows, o), 4, 16)
    assert check.holds and check.name == "batch 4 in batch-1 steps" and check.detail.startswith("1.97 < 2.00")
    assert not timing.batch_cost(sweep(rows, o), 16, 16).holds
    # a 16-row matmul that costs 2.25 matrix-vector products: the midpoint moves to sqrt(16 * 2.25) = 6
    check = timing.batch_cost(sweep(rows, o, read_cost={1: 1.0, 4: 1.0, 16: 2.25}), 16, 16)
    assert check.holds and check.detail.startswith("4.33 < 6.00")
    # a matmul measured faster at 4 rows than at one counts as 1: the bound never drops below sqrt(b)
    assert timing.batch_cost(sweep(rows, o, read_cost={1: 1.0, 4: 0.9, 16: 1.0}), 4, 16).detail.startswith(
        "1.97 < 2.00"
    )


def prefill_sweep(ttft_s, step_s, overhead_s=None, flops=None, on_cpu=True):
    """A prefill sweep; with `overhead_s` the fixed cost measured, and each prompt's work `flops` per token
    at 1 FLOP/s (seconds per token)."""
    prefills = tuple(timing.StepTiming(1, p, (t,)) for p, t in ttft_s.items())
    overhead = None if overhead_s is None else timing.StepTiming(1, min(ttft_s), (overhead_s,))
    work = {p: p * flops for p in ttft_s} if flops else {}
    step = timing.StepTiming(1, min(ttft_s), (step_s,))
    return timing.PrefillSweep(prefills, step, overhead, work, on_cpu)


def test_prefill_checks():
    good = prefill_sweep({16: 4e-3, 64: 12.8e-3, 256: 34e-3, 1024: 175e-3, 2048: 466e-3}, 2.3e-3)
    assert (
        good.cheapest == 256
        and good.growth == pytest.approx(116.5)
        and good.at_once == pytest.approx(0.099, rel=0.01)
    )
    assert failed(timing.check_prefill(good)) == []
    # one token at a time: as slow as that many decode steps, and no fixed floor
    token_by_token = prefill_sweep({p: p * 2.3e-3 for p in (16, 64, 256, 1024, 2048)}, 2.3e-3)
    assert failed(timing.check_prefill(token_by_token)) == [
        "a short prompt pays a fixed floor",
        "prefill over one token at a time",
    ]
    with pytest.raises(ValueError, match="increasing"):
        timing.sweep_prefill(tiny_model(config=CONFIG, device="cpu"), [64, 16, 256])


LENS = (16, 64, 256, 1024, 2048)


def test_the_prefill_growth_is_held_only_where_the_long_end_is_work():
    """A small model on a GPU: every prefill costs its launches (0.5 ms), the work is microseconds. The growth
    claims would miss every attempt; the sweep says it is launch-bound and holds the claims that remain true."""
    launch_bound = prefill_sweep({p: 0.5e-3 + p * 1e-8 for p in LENS}, 0.4e-3, 0.5e-3, 1e-8, on_cpu=False)
    assert launch_bound.dominance() == pytest.approx(1024e-8 / 0.5e-3)
    assert launch_bound.regime().startswith("launch-bound at these sizes: the 1,024-token prefill's")
    checks = timing.check_prefill(launch_bound)
    assert [c.name for c in checks] == [
        "a short prompt pays a fixed floor",
        "prefill over one token at a time",
    ]
    assert failed(checks) == []
    # the same numbers on a CPU: the sizes must make the long end work, or CI would never check the growth
    on_cpu = replace(launch_bound, on_cpu=True)
    assert failed(timing.check_prefill(on_cpu)) == ["the CPU sizes make the long end work"]
    # where the work is predicted to dominate, a TTFT that does not grow misses (the claim still catches it)
    flat = prefill_sweep({p: 4e-3 + p * 1e-7 for p in LENS}, 2.3e-3, 1e-3, 1e-5)
    assert flat.work_bound() and flat.regime().startswith("work-bound: the 1,024-token prefill's")
    assert failed(timing.check_prefill(flat)) == [
        "TTFT grows with the prompt",
        "the long end is compute-bound",
    ]


def test_prefill_sweep_measures_every_length_in_rounds():
    model = tiny_model(config=CONFIG, device="cpu")
    s = timing.sweep_prefill(model, [4, 8, 16], repeat=2, rounds=2, step_repeat=1)
    assert s.prompt_lens == [4, 8, 16] and all(len(p.seconds) == 4 for p in s.prefills)
    assert len(s.step.seconds) == 2 and s.step.tokens == 4
    assert len(s.overhead.seconds) == 2 and set(s.work_s) == {4, 8, 16}
    assert s.on_cpu and 0 < s.work_s[4] < s.work_s[8] < s.work_s[16] and s.overhead_s > 0
    # 4 checks, and on a CPU whether the sizes make the long end work
    names = [c.name for c in timing.check_prefill(s)]
    assert names[0] == "the CPU sizes make the long end work" and len(names) in (3, 5)


def recompute_sweep(times, overhead_s, on_cpu=True):
    rows = tuple(
        decode.RecomputeTiming(L, timing.StepTiming(1, L + 1, (c,)), timing.StepTiming(1, L + 1, (u,)))
        for L, (c, u) in times.items()
    )
    overhead = timing.StepOverhead(timing.StepTiming(1, 1, (overhead_s,)), 4, 0.0)
    return decode.RecomputeSweep(rows, overhead, on_cpu)


def test_recompute_checks():
    o = 1.2e-3
    good = recompute_sweep({16: (1.6e-3, 2.4e-3), 64: (1.9e-3, 12e-3), 1024: (2.4e-3, 1.4)}, o)
    assert [r.history for r in good.dominated] == [64, 1024] and good.threshold_s == decode.WORK_DOMINATES * o
    checks = decode.check_recompute(good)
    assert failed(checks) == [] and [c.name for c in checks][1:] == [
        "L=64: 2 < recompute/cached",
        "L=1024: 2 < recompute/cached",
    ]
    # the cache dropped every step: the "cached" step recomputes the history too
    dropped = recompute_sweep({16: (2.4e-3, 2.4e-3), 64: (12e-3, 12e-3), 1024: (1.4, 1.4)}, o)
    assert failed(decode.check_recompute(dropped)) == [
        "L=64: 2 < recompute/cached",
        "L=1024: 2 < recompute/cached",
    ]
    # launch-bound at every length: a failure on a CPU, where CI must check the claim; not on a GPU
    small = recompute_sweep({16: (1.6e-3, 2.4e-3)}, o)
    assert failed(decode.check_recompute(small)) == ["a history where work dominates (required on a CPU)"]
    assert failed(decode.check_recompute(recompute_sweep({16: (1.6e-3, 2.4e-3)}, o, on_cpu=False))) == []


def test_recompute_sweep_and_flops():
    model = tiny_model(
        "llama", layers=2, hidden=64, heads=4, kv_heads=2, attn_implementation="eager", device="cpu"
    )
    s = decode.sweep_recompute(model, [4, 16], repeat=1, rounds=2)
    assert [r.history for r in s.rows] == [4, 16] and s.on_cpu
    assert all(len(r.cached.seconds) == 2 == len(r.uncached.seconds) for r in s.rows)
    assert len(s.overhead.timing.seconds) == 2 and math.isfinite(s.rows[0].ratio)
    f = decode.step_flops(model, 16)
    assert f.uncached_flops == 17 * f.cached_flops
    with pytest.raises(ValueError, match="history"):
        decode.step_flops(model, 0)


def test_a_claim_run_end_to_end_prints_every_attempt():
    lines = []
    verdict = claims.measure_claim(
        "recompute",
        lambda: recompute_sweep({64: (12e-3, 12e-3)}, 1.2e-3),
        decode.check_recompute,
        attempts=2,
        log=lines.append,
    )
    assert not verdict.holds and verdict.count == 2 and len(lines) == 2
    with pytest.raises(AssertionError, match=r"L=64: 2 < recompute/cached: MISSES"):
        verdict.require()
