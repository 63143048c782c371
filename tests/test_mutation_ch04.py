"""Chapter 4's timing claim catches a predicted bandwidth halved and a roofline whose bytes are doubled (slow:
real timings).

Each mutation is applied to the kvlab functions the lab calls (`timing.sweep_decode`, `timing.check_roofline`), on
a smaller model than the lab's (half its layers: the same widths, so the same bandwidth-bound regime), with one
attempt: the verdict must miss, and name the check that caught it.
"""

import dataclasses

import pytest
import torch

from kvlab import claims, models
from kvlab.costs import roofline
from kvlab.experiments import timing
from kvlab.specs import hardware

pytestmark = [pytest.mark.slow, pytest.mark.timed]

CONTEXTS, BATCHES = [16, 64, 256], [1, 4]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return models.tiny_model("llama", layers=4, hidden=1024, heads=16, kv_heads=8, vocab=1024, seed=0)


def run(model):
    verdict = claims.measure_claim(
        "roofline",
        lambda: timing.sweep_decode(model, timing.decode_points(CONTEXTS, BATCHES, 16), repeat=3, rounds=5),
        lambda s: timing.check_roofline(s, CONTEXTS, BATCHES, 16, dominance=3, ratio_high=2),
        attempts=1,
    )
    assert not verdict.holds
    missed = [c.name for c in verdict.attempts[-1].misses]
    # the prediction about doubles: some batch-1 step comes in below the lowest measured/predicted it allows
    assert any(name.startswith("batch 1, context") for name in missed), missed


def test_a_predicted_bandwidth_halved_misses(model, monkeypatch):
    # both probes: the roofline runs on the copy's rate on a GPU, on the matrix-vector product's on a CPU
    copy_rate, read_rate = hardware.CopyProbe.bandwidth_bytes_per_s, hardware.LinearProbe.read_bytes_per_s
    monkeypatch.setattr(
        hardware.CopyProbe, "bandwidth_bytes_per_s", property(lambda p: copy_rate.fget(p) / 2)
    )
    monkeypatch.setattr(hardware.LinearProbe, "read_bytes_per_s", property(lambda p: read_rate.fget(p) / 2))
    run(model)


def test_a_roofline_with_its_bytes_doubled_misses(model, monkeypatch):
    real = roofline._decode

    def doubled(*args):
        step = real(*args)
        # every byte count: the weights' and the cache's (the memory term splits them by rate on a CPU)
        return dataclasses.replace(
            step,
            bytes=2 * step.bytes,
            weight_bytes=2 * step.weight_bytes,
            kv_bytes=2 * step.kv_bytes,
            memory_s=2 * step.memory_s,
        )

    monkeypatch.setattr(roofline, "_decode", doubled)
    run(model)
