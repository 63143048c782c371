"""Chapter 9's timing claims catch a wrong engine or a wrong cost: prefix caching silently off, the prefill cost
doubled.

Each mutation goes through the same `kvlab.experiments.prefix_ttft` measurements and checks the lab runs through
`kvlab.claims.measure_claim`, on the same real model (SmolLM2-135M) at smaller sizes, one attempt:

- hits reported but recomputed: the block manager finds and reports the cached prefix, then the engine computes
  every prompt token anyway;
- the cache never hits: the block manager finds no cached block;
- the prefill cost doubled: the prediction charges twice the calibrated cost.

Each must fail the claim. The verdict must name a timing check where the mutation leaves every count right (the
doubled cost) or moves the time far at these sizes (hits recomputed). A cache that never hits is caught by the exact
counts on every machine, and its timing miss is not required: at these sizes a recomputed prefix may move the mean
TTFT less than the claim's tolerance.
"""

from __future__ import annotations

import pytest

from kvlab import claims, models
from kvlab.engine.block_manager import BlockManager, ComputedBlocks
from kvlab.engine.scheduler import Scheduler
from kvlab.experiments import prefix_ttft as pt
from kvlab.planning import simulate as sim

pytestmark = [pytest.mark.slow, pytest.mark.timed]

# a prefix long beside a request's own part: with caching on the prediction is far below a full prefill, whatever
# share of a step a loaded machine's overhead takes
PREFIX, OWN, REQUESTS, BLOCK = 192, 16, 3, 16
TOLERANCE = 0.4


@pytest.fixture(scope="module")
def real():
    return models.real_model(device="cpu")[0]


def sharing_verdict(real):
    ids = pt.RandomIds(real.config.vocab_size, seed=0)
    system = ids(PREFIX)
    knobs = pt.engine_knobs(BLOCK, 64, PREFIX + OWN)
    cal = pt.calibration_trace(ids, OWN, PREFIX + OWN)
    with sim.quiet_torch():
        return claims.measure_claim(
            "caching on: TTFT falls with sharing, as predicted",
            lambda: pt.measure_sharing(real, ids, system, [0.0, 1.0], REQUESTS, OWN, cal, 1, knobs),
            lambda runs: pt.check_sharing(runs, TOLERANCE),
            attempts=1,
            log=None,
        )


def probe_verdict(real):
    ids = pt.RandomIds(real.config.vocab_size, seed=0)
    system = ids(PREFIX)
    knobs = pt.engine_knobs(BLOCK, 64, PREFIX + OWN)
    cal = pt.calibration_trace(ids, OWN, PREFIX + OWN)
    with sim.quiet_torch():
        return claims.measure_claim(
            "the hit is visible in TTFT",
            lambda: pt.measure_probes(real, ids, system, OWN, cal, 1, knobs),
            lambda run: pt.check_probes(run, PREFIX, TOLERANCE),
            attempts=1,
            log=None,
        )


def missed(verdict) -> set[str]:
    assert not verdict.holds
    with pytest.raises(AssertionError, match="missed all 1 attempts"):
        verdict.require()
    return {check.name for check in verdict.attempts[-1].misses}


@pytest.fixture
def recompute_hits(monkeypatch):
    """The cached prefix is found and counted as a hit, then computed again."""
    original = Scheduler._admit

    def admit(self, seq, budget):
        admitted = original(self, seq, budget)
        if admitted is None or not seq.num_computed_tokens:
            return admitted
        admitted += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        return admitted

    monkeypatch.setattr(Scheduler, "_admit", admit)


@pytest.fixture
def never_hits(monkeypatch):
    monkeypatch.setattr(
        BlockManager, "get_computed_blocks", lambda self, seq: ComputedBlocks([[] for _ in self.managers], 0)
    )


def test_hits_reported_but_recomputed_fail_the_sharing_claim(real, recompute_hits):
    names = missed(sharing_verdict(real))
    assert "100% sharing: prefill tokens scheduled, caching on" in names
    assert "100% sharing, caching on: mean TTFT (ms) as predicted" in names, names
    assert "100% sharing: prefix hits the engine reported" not in names  # the hits are reported


def test_a_cache_that_never_hits_fails_the_sharing_claim(real, never_hits):
    names = missed(sharing_verdict(real))
    # The exact counts catch it on every machine; whether the TTFT check also misses depends on how far a
    # recomputed prefix moves the mean at these sizes, so it is not required.
    assert "100% sharing: prefix hits the engine reported" in names, names
    assert "100% sharing: prefill tokens scheduled, caching on" in names, names


def test_a_doubled_prefill_cost_fails_the_sharing_claim(real, monkeypatch):
    fitted = pt.prefill_cost

    def doubled(steps):
        cost = fitted(steps)
        return sim.LinearStepCost(2 * cost.overhead_s, 2 * cost.per_token_s)

    monkeypatch.setattr(pt, "prefill_cost", doubled)
    names = missed(sharing_verdict(real))
    assert any(name.endswith("mean TTFT (ms) as predicted") for name in names), names
    assert not any("scheduled" in name or "hits" in name for name in names)  # the counts are right


def test_a_cache_that_never_hits_fails_the_probe_claim(real, never_hits):
    names = missed(probe_verdict(real))
    assert "shared cache: right guess, cached tokens" in names
    assert "shared cache: TTFT of the right guess over the wrong one as predicted" in names, names


def test_hits_reported_but_recomputed_fail_the_probe_claim(real, recompute_hits):
    names = missed(probe_verdict(real))
    assert "shared cache: TTFT of the right guess over the wrong one as predicted" in names, names
