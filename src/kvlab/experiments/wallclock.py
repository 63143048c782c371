"""Chapter 8's wall-clock claim: continuous beats static batching on a real model, as the simulator predicts.

One measurement (`measure_schedulers`) serves the same trace under static and under continuous batching on the
wall clock and predicts both from a step cost calibrated on ANOTHER trace: `kvlab.planning.simulate.simulate` replays
the trace through the engine's own scheduler, charged the calibrated cost. `check_schedulers` states the claim
as `kvlab.claims` checks on that one measurement: continuous batching has the higher output throughput and the
lower P50 and P99 TTFT; throughput, P50 and P99 TTFT and P50 ITL of each scheduler are within `tolerance` of
the prediction; and each scheduler's P50 ITL lies in the band the calibrated cost allows. The lab runs them
through `kvlab.claims.measure_claim`, so a miss on a shared machine re-measures, a bounded number of times.

The calibration trace is served under both schedulers, so it has decode steps of every batch size the measured
runs have (a static batch drains from `max_num_seqs` sequences to one), and the six replays run in the order
calibration static, then the measured trace static, continuous, continuous, static, then calibration continuous: a
machine whose speed drifts linearly over the minute slows the calibration and the measurement alike. Each
scheduler's measurement is the mean of its two runs (`SchedulerComparison.summaries`). The machines this was
built on also change speed by about a third for some seconds at a time; with one run each, static once ran in
a fast spell and continuous in a slow one, and static came out ahead on throughput (2 attempts of 8 on this
project's machine in one hour, once in CI). In the order static, continuous, continuous, static, one such
change biases the two means against each other by at most the change's size over two runs (about 14 % for a
third), not by the whole change; a steady drift cancels. The step cost is
`kvlab.planning.simulate.BatchCorrectedCost`: linear, with decode steps scaled per batch size as measured (a CPU's
matmul kernel changes with the row count, so the cost is not linear in the sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab import claims
from kvlab.costs.workloads import TraceRequest
from kvlab.planning import simulate as sim

SCHEDULERS = ("static", "continuous")
# What is compared with the prediction: vLLM's metric names, and how the lab's tables name them.
PREDICTED_KEYS = {
    "output_throughput": "output tok/s",
    "median_ttft_ms": "P50 TTFT (ms)",
    "p99_ttft_ms": "P99 TTFT (ms)",
    "median_itl_ms": "P50 ITL (ms)",
}
SHOWN_KEYS = PREDICTED_KEYS | {"p99_itl_ms": "P99 ITL (ms)"}


@dataclass(frozen=True)
class SchedulerComparison:
    """One measurement: the calibration, each scheduler's two measured runs, and its prediction."""

    trace: tuple[TraceRequest, ...]
    calibration: sim.Calibration
    cost: sim.BatchCorrectedCost
    # Each scheduler's first run and its second (the same tokens and steps; only the times differ)
    measured: dict[str, sim.EngineRun]
    repeats: dict[str, sim.EngineRun]
    predicted: dict[str, sim.SimulationResult]

    def summaries(self) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
        """Per scheduler: (measured, predicted) summaries, vLLM's keys; measured is the mean of its two runs."""
        out = {}
        for s in SCHEDULERS:
            first, second = self.measured[s].summary(), self.repeats[s].summary()
            out[s] = ({k: (first[k] + second[k]) / 2 for k in first}, self.predicted[s].summary())
        return out

    def ttfts_ms(self, scheduling: str) -> list[float]:
        """Each request's measured TTFT (ms), the mean of the scheduler's two runs, in trace order."""
        runs = self.measured[scheduling].requests, self.repeats[scheduling].requests
        return [1e3 * (a.ttft + b.ttft) / 2 for a, b in zip(*runs, strict=True)]

    def errors(self) -> dict[str, dict[str, float]]:
        """Per scheduler: measured / predicted - 1 for each of `PREDICTED_KEYS` (what the checks bound)."""
        return {
            s: {k: measured[k] / predicted[k] - 1 for k in PREDICTED_KEYS}
            for s, (measured, predicted) in self.summaries().items()
        }

    def itl_band_ms(self) -> tuple[float, float]:
        """A step that carries a running request costs at least a lone decode step (the shortest prompt's) and
        at most the costliest step the simulator scheduled, both from the calibrated cost."""
        shortest = min(len(r.prompt_token_ids) for r in self.trace)
        costliest = max(max(self.predicted[s].step_seconds) for s in SCHEDULERS)
        return 1e3 * self.cost.of(1, shortest + 1, 1), 1e3 * costliest


def fit_step_cost(steps: Sequence[sim.StepRecord]) -> tuple[sim.Calibration, sim.BatchCorrectedCost]:
    """The calibration of `steps` (wall clock) and the batch-corrected cost the prediction is charged."""
    calibration = sim.Calibration(sim.fit_linear_cost(steps), list(steps), "wall")
    return calibration, calibration.batch_corrected()


def measure_schedulers(
    model: Any,
    trace: Sequence[TraceRequest],
    calibration_trace: Sequence[TraceRequest],
    *,
    logprobs: int | None = None,
    **engine_knobs: Any,
) -> SchedulerComparison:
    """Calibrate on `calibration_trace`, measure `trace` under both schedulers on the wall clock, predict it.

    One torch thread and no garbage collection throughout (`kvlab.planning.simulate.quiet_torch`), after a warm-up replay
    of the calibration trace's first two requests. `logprobs` keeps each token's best ids for the agreement
    check. `engine_knobs` go to the engine and to the simulator alike.
    """
    trace, calibration_trace = tuple(trace), tuple(calibration_trace)

    def run(t: Sequence[TraceRequest], scheduling: str) -> sim.EngineRun:
        return sim.record_engine_steps(
            model, t, "wall", logprobs=logprobs, scheduling=scheduling, **engine_knobs
        )

    with sim.quiet_torch():
        run(calibration_trace[:2], "continuous")
        cal_static = run(calibration_trace, "static")
        measured = {s: run(trace, s) for s in SCHEDULERS}
        repeats = {s: run(trace, s) for s in reversed(SCHEDULERS)}
        cal_continuous = run(calibration_trace, "continuous")
    calibration, cost = fit_step_cost(cal_static.steps + cal_continuous.steps)
    predicted = {s: sim.simulate(trace, cost, scheduling=s, **engine_knobs) for s in SCHEDULERS}
    return SchedulerComparison(trace, calibration, cost, measured, repeats, predicted)


def check_schedulers(c: SchedulerComparison, tolerance: float) -> list[claims.Check]:
    """The chapter's claims on one measurement (see the module docstring)."""
    summaries = c.summaries()
    (m_static, p_static), (m_cont, p_cont) = summaries.values()
    checks = [
        claims.less(
            "continuous has the higher output throughput (static < continuous)",
            m_static["output_throughput"],
            m_cont["output_throughput"],
        ),
        claims.less(
            "continuous has the lower P50 TTFT", m_cont["median_ttft_ms"], m_static["median_ttft_ms"]
        ),
        claims.less("continuous has the lower P99 TTFT", m_cont["p99_ttft_ms"], m_static["p99_ttft_ms"]),
    ]
    for s, (measured, predicted) in summaries.items():
        checks += [
            claims.within(f"{s} {name} as predicted", measured[k], predicted[k], tolerance)
            for k, name in PREDICTED_KEYS.items()
        ]
    low, high = c.itl_band_ms()
    checks += [
        claims.between(
            f"{s} P50 ITL (ms) in the calibrated band",
            measured["median_itl_ms"],
            (1 - tolerance) * low,
            (1 + tolerance) * high,
        )
        for s, (measured, _) in summaries.items()
    ]
    return checks
