"""Chapter 17's transfer claim catches a link model whose bandwidth is doubled or halved, and a prediction twice
or half the truth (slow: real transfers between two processes).

Each verdict goes through `kvlab.claims.measure_claim` with the lab's three attempts, each attempt a fresh
`pd.run_disaggregated` (the function the lab calls, with its prompts, probe, rounds and `overlap=False`), each
prompt decoding 2 tokens where the lab's decode 8. The attempts are measured once and shared by the verdicts in the
order each asks for them. The mutant is the link each attempt fitted, changed, passed to
`DisaggResult.transfer_checks` at the lab's band: it must miss every attempt, and name the check that caught it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

from kvlab import claims, models
from kvlab.disagg import pd
from kvlab.engine import SamplingParams
from kvlab.engine.config import EngineConfig

pytestmark = [pytest.mark.slow, pytest.mark.timed]

# the lab's band, model, prompt lengths (1 to 12 MiB of K/V), probe and rounds
BAND = (0.67, 1.5)
KNOBS = dict(layers=4, hidden=256, heads=4, kv_heads=4, vocab=512)
PROMPT_LENS = [128, 256, 384, 512, 768, 1024, 1280, 1536]
ATTEMPTS = 3
LEVEL = "median measured / predicted"
GROWTH = "seconds per byte, requests / link"


class Attempts:
    """Fresh two-process runs, made when a verdict first asks for the n-th and kept for the others."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        factory = functools.partial(models.tiny_model, "llama", seed=0, dtype=torch.float32, **KNOBS)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, KNOBS["vocab"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
        blocks = sum(-(-(n + 8) // 16) for n in PROMPT_LENS)
        self.run = functools.partial(
            pd.run_disaggregated,
            factory,
            prompts,
            SamplingParams(max_tokens=2, ignore_eos=True),
            EngineConfig(block_size=16, num_blocks=blocks, max_num_batched_tokens=512),
            EngineConfig(block_size=16, num_blocks=blocks),
            probe_sizes=[1 << 20, 1 << 22, 12 << 20],
            probe_repeats=40,
            overlap=False,
        )
        self.results: list[pd.DisaggResult] = []

    def verdict(self, mutate) -> claims.Verdict[pd.DisaggResult]:
        numbers = itertools.count()

        def measure() -> pd.DisaggResult:
            n = next(numbers)
            while len(self.results) <= n:
                self.results.append(self.run())
            return self.results[n]

        def check(result: pd.DisaggResult) -> list[claims.Check]:
            return result.transfer_checks(BAND, mutate(result.link))

        return claims.measure_claim(
            "transfer time predicted from the probe", measure, check, ATTEMPTS, log=None
        )


@pytest.fixture(scope="module")
def attempts():
    return Attempts()


def test_the_fitted_link_holds(attempts):
    """The control: the same attempts with the link as fitted hold, as the lab's do."""
    verdict = attempts.verdict(lambda link: link)
    assert verdict.holds, verdict.summary()


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_bandwidth_doubled_or_halved_misses(attempts, factor):
    verdict = attempts.verdict(lambda link: dataclasses.replace(link, bytes_per_s=factor * link.bytes_per_s))
    assert not verdict.holds and verdict.count == ATTEMPTS
    assert all(GROWTH in {c.name for c in a.misses} for a in verdict.attempts), verdict.attempts
    with pytest.raises(AssertionError, match="seconds per byte, requests / link: MISSES"):
        verdict.require()


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_prediction_twice_or_half_the_truth_misses(attempts, factor):
    """Latency and seconds per byte both scaled: every prediction is `factor` times the fitted link's."""

    def wrong(link: pd.LinkFit) -> pd.LinkFit:
        return dataclasses.replace(
            link, latency_s=factor * link.latency_s, bytes_per_s=link.bytes_per_s / factor
        )

    verdict = attempts.verdict(wrong)
    assert not verdict.holds and verdict.count == ATTEMPTS
    assert all(LEVEL in {c.name for c in a.misses} for a in verdict.attempts), verdict.attempts
