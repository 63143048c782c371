"""Chapter 3's timing claims catch a prefill run one token at a time and a roofline whose bandwidth is 2x wrong,
in both directions (slow: real timings).

Each mutation is applied to the kvlab functions the lab calls (`timing.sweep_prefill` / `timing.check_prefill`,
`timing.sweep_decode` / `timing.check_context_growth`), at the lab's CPU model and sizes. The prefill mutation
takes one attempt; the decode ones take the lab's three and must miss every one, the bandwidth doubled at the
median work check (`timing.work_band`), so the verdict is the claim's, not one lucky sample's.
"""

import pytest
import torch
from test_mutation_ch04 import MEDIAN, every_attempt_missed, scale_bandwidth
from transformers import DynamicCache

from kvlab import claims, models
from kvlab.experiments import timing
from kvlab.measure import Timer

pytestmark = [pytest.mark.slow, pytest.mark.timed]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return models.tiny_model("llama", layers=4, hidden=256, heads=4, kv_heads=4, vocab=1024, seed=0)


@torch.inference_mode()
def prefill_token_by_token(model, ids, clock=None):
    cache = DynamicCache(config=model.config)
    with Timer(model.device, clock=clock) as timer:
        for i in range(ids.shape[1]):
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
    return timer.seconds


def test_a_prefill_timed_one_token_at_a_time_misses(model, monkeypatch):
    monkeypatch.setattr(timing, "_prefill_once", prefill_token_by_token)
    verdict = claims.measure_claim(
        "prefill",
        lambda: timing.sweep_prefill(model, [16, 64, 256], rounds=2),
        timing.check_prefill,
        attempts=1,
    )
    assert not verdict.holds
    assert "prefill over one token at a time" in [c.name for c in verdict.attempts[-1].misses]


# The lab's contexts, batches and attempts (book/03_prefill_decode/lab.ipynb's `parameters`)
CONTEXTS, BATCHES, ATTEMPTS, BAND = [16, 256, 1024, 4096], [1, 16], 3, (0.8, 1.5)


def decode_claim(model, caught_by):
    """The lab's decode claim, with its attempts: it must miss every one, at a check named in `caught_by`."""
    points = timing.decode_points(CONTEXTS, BATCHES, 128)
    verdict = claims.measure_claim(
        "decode",
        lambda: timing.sweep_decode(model, points, repeat=3, rounds=5),
        lambda s: timing.check_context_growth(
            s, CONTEXTS, BATCHES, 128, min_predicted_growth=1.5, ratio_high=2, band=BAND
        ),
        attempts=ATTEMPTS,
    )
    every_attempt_missed(verdict, ATTEMPTS, caught_by)


def test_a_predicted_bandwidth_halved_misses(model, monkeypatch):
    # every step's work predicted twice as long: the median work ratio halves, below the band, and the short
    # contexts' steps fall below their floor too
    scale_bandwidth(monkeypatch, 0.5)
    decode_claim(model, {MEDIAN} | {f"batch 1, context {c}: measured/predicted" for c in CONTEXTS})


def test_a_predicted_bandwidth_doubled_misses(model, monkeypatch):
    # every step's work predicted in half the time: the median work ratio doubles, above the band (the
    # per-step ceiling of 2 on measured/predicted let this through at the short contexts, mostly overhead)
    scale_bandwidth(monkeypatch, 2)
    decode_claim(model, {MEDIAN})
