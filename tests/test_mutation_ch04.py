"""Chapter 4's timing claim catches a roofline whose bandwidth is 2x wrong, in both directions (slow: real
timings).

Each mutation is applied to the kvlab functions the lab calls (`timing.sweep_decode`, `timing.check_roofline`),
on a smaller model than the lab's (half its layers: the same widths, so the same bandwidth-bound regime), with
the lab's three attempts: the claim must miss all of them, the bandwidth doubled each time at the median work
check (`timing.work_band`), so the verdict is the claim's, not one lucky sample's.
"""

import pytest
import torch

from kvlab import claims, models
from kvlab.experiments import timing
from kvlab.specs import hardware

pytestmark = [pytest.mark.slow, pytest.mark.timed]

CONTEXTS, BATCHES = [16, 64, 256], [1, 4]
# The lab's attempts (book/04_bandwidth_bound/lab.ipynb, `attempts`)
ATTEMPTS = 3
MEDIAN = "batch 1: median of (step - overhead) / predicted work"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return models.tiny_model("llama", layers=4, hidden=1024, heads=16, kv_heads=8, vocab=1024, seed=0)


def scale_bandwidth(monkeypatch, factor):
    """Every rate the roofline runs on times `factor`: the copy's on a GPU, the matrix-vector product's on a
    CPU; the fastest of the sweep and each round's alike (both go through `bandwidth_at` and `read_rate_at`)."""
    copy_rate, read_rate = hardware.CopyProbe.bandwidth_at, hardware.LinearProbe.read_rate_at
    monkeypatch.setattr(hardware.CopyProbe, "bandwidth_at", lambda p, s: copy_rate(p, s) * factor)
    monkeypatch.setattr(hardware.LinearProbe, "read_rate_at", lambda p, s: read_rate(p, s) * factor)


def run(model, caught_by):
    """The lab's claim, with its attempts: it must miss every one, at a check named in `caught_by`."""
    verdict = claims.measure_claim(
        "roofline",
        lambda: timing.sweep_decode(model, timing.decode_points(CONTEXTS, BATCHES, 16), repeat=3, rounds=5),
        lambda s: timing.check_roofline(s, CONTEXTS, BATCHES, 16, dominance=3, ratio_high=2),
        attempts=ATTEMPTS,
    )
    every_attempt_missed(verdict, ATTEMPTS, caught_by)


def every_attempt_missed(verdict, attempts, caught_by):
    """The claim took all `attempts` and missed each one at a check named in `caught_by`."""
    assert not verdict.holds and verdict.count == attempts
    for attempt in verdict.attempts:
        missed = [c.name for c in attempt.misses]
        assert any(name in caught_by for name in missed), missed


def test_a_predicted_bandwidth_halved_misses(model, monkeypatch):
    # every step's work predicted twice as long: the median work ratio halves, below the band, and the steps
    # fall below their floor too
    scale_bandwidth(monkeypatch, 0.5)
    run(model, {MEDIAN} | {f"batch 1, context {c}: measured/predicted" for c in CONTEXTS})


def test_a_predicted_bandwidth_doubled_misses(model, monkeypatch):
    # every step's work predicted in half the time: the median work ratio doubles, above the band (with the
    # per-step band alone, measured/predicted came to about 1.9 here, inside its ceiling of 2)
    scale_bandwidth(monkeypatch, 2)
    run(model, {MEDIAN})
