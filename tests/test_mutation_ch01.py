"""Chapter 1's timing claim catches a cache that does not save anything (slow: real timings).

The mutation is applied to the kvlab functions the lab calls (`decode.sweep_recompute`, `decode.check_recompute`),
at the lab's CPU model and a few of its history lengths, with one attempt: the verdict must miss, and name the
check that caught it.
"""

import pytest

from kvlab import claims, models
from kvlab.experiments import decode

pytestmark = [pytest.mark.slow, pytest.mark.timed]


def test_a_cache_dropped_every_step_misses_the_recompute_ratio(monkeypatch):
    model = models.tiny_model(
        "llama", layers=4, hidden=128, heads=8, kv_heads=2, vocab=512, seed=0, attn_implementation="eager"
    )
    # the "cached" step throws the cache away and recomputes the whole history, as the uncached one does
    monkeypatch.setattr(decode._RecomputeBench, "cached", decode._RecomputeBench.uncached)
    verdict = claims.measure_claim(
        "recompute",
        lambda: decode.sweep_recompute(model, [256, 512, 1024], repeat=1, rounds=2),
        decode.check_recompute,
        attempts=1,
    )
    assert not verdict.holds
    missed = [c.name for c in verdict.attempts[-1].misses]
    assert "L=1024: 2 < recompute/cached" in missed, missed
    assert all("recompute/cached" in name for name in missed), missed
