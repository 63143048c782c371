"""Chapter 3's timing claims catch a prefill run one token at a time and a predicted step cost doubled (slow:
real timings).

Each mutation is applied to the kvlab functions the lab calls (`timing.sweep_prefill` / `timing.check_prefill`,
`timing.sweep_decode` / `timing.check_context_growth`), at the lab's CPU model and a few of its sizes, with one
attempt: the verdict must miss, and name the check that caught it.
"""

import pytest
import torch
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


def test_a_predicted_step_cost_doubled_misses(model, monkeypatch):
    real = timing.predict_bench_step
    monkeypatch.setattr(timing, "predict_bench_step", lambda *args: 2 * real(*args))
    # the lab's contexts and sampling: the step runs 0.9-1.6x its true prediction there, so a doubled one
    # comes in below the floor at one context at least (at every one, in most measurements)
    contexts, batch_sizes = [16, 256, 1024, 4096], [1, 16]
    points = timing.decode_points(contexts, batch_sizes, 128)
    verdict = claims.measure_claim(
        "decode",
        lambda: timing.sweep_decode(model, points, repeat=3, rounds=5),
        lambda s: timing.check_context_growth(
            s, contexts, batch_sizes, 128, min_predicted_growth=1.5, ratio_high=2
        ),
        attempts=1,
    )
    assert not verdict.holds
    missed = [c.name for c in verdict.attempts[-1].misses]
    assert any(name.startswith("batch 1, context") for name in missed), missed
