"""Chapter 14's validation claim catches a wrong simulator: the lab's measure and check, with a mutation applied.

The lab runs `kvlab.planning.simulate.validate` (a tiny Llama on the real engine, timed in process CPU time, against the
simulator charged a cost calibrated on other traces) and `kvlab.planning.simulate.validation_checks` through
`kvlab.claims.measure_claim`. Here the same functions run at the lab's traces with one round per attempt
(`repeats=1`); a control shows that the true claim holds as the lab runs it (3 rounds, 3 attempts), and each mutation of the cost the
simulator is charged gets one attempt and must miss, naming the checks that catch it.

The mutations act on the cost `simulate` is charged, not on the fit: `validate` charges the fitted cost times
a measured/fitted ratio drawn from the calibration steps (`resample=True`), and those ratios would undo any
scaling of the fit itself.
"""

import dataclasses
import functools
import math

import pytest

from kvlab import claims
from kvlab.costs.workloads import synthetic_trace
from kvlab.models import tiny_model
from kvlab.planning import simulate as sim

pytestmark = [pytest.mark.slow, pytest.mark.timed]

# The lab's parameters cell (val_knobs, val_calibration, val_loads)
KNOBS = dict(
    num_blocks=48, block_size=8, max_num_seqs=16, max_num_batched_tokens=64, enable_prefix_caching=False
)


def _trace(n, rate, seed):
    return synthetic_trace(
        n, "sharegpt", request_rate=rate, scale=0.1, seed=seed, max_input_len=60, max_output_len=40
    )


@pytest.fixture(scope="module")
def measure():
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, device="cpu")
    calibration = [_trace(40, math.inf, 11), _trace(20, 10.0, 12)]
    loads = {"6/s": _trace(30, 6.0, 2), "20/s": _trace(40, 20.0, 2), "saturated": _trace(40, math.inf, 2)}
    return functools.partial(
        sim.validate, model, calibration, loads, clock="cpu", repeats=1, resample=True, **KNOBS
    )


def verdict(measure, attempts=1):
    return claims.measure_claim(
        "the simulator predicts the engine",
        measure,
        lambda result: sim.validation_checks(result[1]),
        attempts,
    )


def charged(monkeypatch, mutate):
    """Every simulation `validate` runs is charged `mutate(cost)` instead of its cost."""
    simulate = sim.simulate
    monkeypatch.setattr(sim, "simulate", lambda trace, cost, **kw: simulate(trace, mutate(cost), **kw))


def missed(v):
    assert not v.holds
    return {c.name for c in v.attempts[-1].misses}


def test_the_true_claim_holds_as_the_lab_runs_it(measure):
    v = verdict(functools.partial(measure, repeats=3), attempts=3)
    assert v.holds, v.attempts[-1].misses


def _loads_missing(misses, key):
    return {name.split()[0] for name in misses if name.endswith(key)}


# A load's calibration and validation replays can differ in speed twofold on a shared machine, even in process
# CPU time (seen once at load 4.5: no saturated check missed with the overhead dropped), so a mutation is
# required to show at two loads of three, not at all three.


def test_a_doubled_cost_misses_the_latencies(measure, monkeypatch):
    charged(monkeypatch, lambda cost: lambda new, context: 2 * cost(new, context))
    misses = missed(verdict(measure))
    # A doubled step is a doubled latency (+100 %), more past saturation where queueing adds to it.
    assert len(_loads_missing(misses, "median_itl")) >= 2, misses
    assert len(_loads_missing(misses, "median_e2el")) >= 2, misses


def test_the_per_step_overhead_dropped_misses(measure, monkeypatch):
    def dropped(cost):
        return dataclasses.replace(cost, base=dataclasses.replace(cost.base, overhead_s=0.0))

    charged(monkeypatch, dropped)
    misses = missed(verdict(measure))
    # The overhead (with the host gap) is most of a tiny model's step: latencies fall by more than half.
    assert len(_loads_missing(misses, "median_itl")) >= 2, misses
    assert len(_loads_missing(misses, "median_e2el")) >= 2, misses
