"""Chapter 12's timing claim catches a wrong loop: the offloaded tier not read, or read twice.

The mutation goes through the same `kvlab.offload.cost.measure_offload` and `check_offload` the lab runs through
`kvlab.claims.measure_claim`, at the lab's model size and a shorter run (one context, the lab's 40 steps, one attempt). The
mutant layers write their blocks to disk and re-read them from disk when the transfers are timed, so the tier's
bandwidth is measured as usual, but their decode steps serve the K/V from a copy kept in RAM: a cache that claims
the tier and does not pay for it. A second mutant reads its blocks twice in every decode step (and once when the
transfers are timed): a cache that pays for its transfer twice. The band must reject both.

The reload claim (`kvlab.offload.reload.check_reload`) goes through `measure_claim` with the lab's prompt and
attempts, its prediction made wrong by a factor of 2 either way, for the recompute and for the reload: each of the
four must miss on every attempt.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from kvlab import claims, models
from kvlab.offload.cache import DiskLayer, OffloadedCache
from kvlab.offload.cost import check_offload, measure_offload
from kvlab.offload.loop import decode_lockstep, random_prompt
from kvlab.offload.reload import check_reload, predict_reload, time_reload

pytestmark = [pytest.mark.slow, pytest.mark.timed]

BAND = "1024 tokens: offloaded step (ms) in the band around compute + transfer"


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    # one thread: the steps are timed in thread CPU time, as in the lab
    torch.set_num_threads(1)
    yield models.tiny_model(
        "llama", layers=4, hidden=256, heads=8, kv_heads=8, vocab=256, seed=0, device="cpu"
    )
    torch.set_num_threads(threads)


class MutantLayer(DiskLayer):
    """A disk layer that knows whether its read is the timed repeat (`reread`) or the decode step's."""

    def __init__(self, path, block_bytes: int) -> None:
        super().__init__(path, block_bytes)
        self._rereading = False

    def reread(self, clock=time.perf_counter):
        self._rereading = True
        try:
            return super().reread(clock)
        finally:
            self._rereading = False


class TierNotRead(MutantLayer):
    """Writes every block to disk, but decodes from a RAM copy; only `reread` (the timed transfer) reads disk."""

    def __init__(self, path, block_bytes: int) -> None:
        super().__init__(path, block_bytes)
        self._ram = bytearray()
        self.disk_reads = 0  # reads that went to the file

    def _write_blocks(self, records: torch.Tensor) -> None:
        super()._write_blocks(records)
        self._ram += records.contiguous().view(torch.uint8).numpy().tobytes()

    def _read(self, view: memoryview) -> int:
        if self._rereading:
            self.disk_reads += 1
            return super()._read(view)
        # one memcpy from the RAM copy: what a layer holding its K/V in memory pays
        np.frombuffer(view, dtype=np.uint8)[:] = np.frombuffer(self._ram, np.uint8, len(view))
        return len(view)


class TierReadTwice(MutantLayer):
    """Reads every full block from disk twice per decode step; `reread` (the timed transfer) reads them once."""

    def _read(self, view: memoryview) -> int:
        if not self._rereading:
            super()._read(view)
        return super()._read(view)


def mutant_cache(layer_class):
    def make(config, layers, tier):
        cache = OffloadedCache(config, layers, tier=tier)
        for index in layers:
            cache.layers[index] = layer_class(cache.layers[index].path, 64 * 1024)
        return cache

    return make


tier_not_read = mutant_cache(TierNotRead)


def verdict(model, make_cache):
    return claims.measure_claim(
        "offloaded step = compute + transfer",
        lambda: measure_offload(model, [1024], [1, 2, 3], "disk", 41, make_cache=make_cache),
        check_offload,
        attempts=1,
        log=None,
    )


def test_the_mutant_decodes_the_same_tokens_and_reads_disk_only_when_timed(model):
    with tier_not_read(model.config, [1, 2, 3], "disk") as cache:
        runs = decode_lockstep(model, random_prompt(256, 1, 300), 5, [None, cache])
        assert runs[0].tokens == runs[1].tokens
        layer = cache.layers[1]
        # it reports the tier's bytes as read, and never read them
        assert layer.disk_tokens > 0 and layer.bytes_read_from_disk > 0 and layer.disk_reads == 0
        nbytes, seconds = cache.reread()
        assert nbytes > 0 and seconds > 0 and layer.disk_reads == 1


def test_a_cache_that_does_not_read_its_tier_fails_the_band(model):
    result = verdict(model, tier_not_read)
    assert not result.holds
    missed = {check.name for check in result.attempts[-1].misses}
    assert BAND in missed, missed
    with pytest.raises(AssertionError, match="offloaded step \\(ms\\) in the band"):
        result.require()


def test_a_cache_that_reads_its_tier_twice_fails_the_band(model):
    result = verdict(model, mutant_cache(TierReadTwice))
    assert not result.holds
    missed = {check.name for check in result.attempts[-1].misses}
    assert BAND in missed, missed


@pytest.mark.parametrize("side", ["recompute_s", "reload_s"])
@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_reload_prediction_twice_or_half_the_truth_fails(model, side, factor):
    ids = random_prompt(256, 1, 1024)

    def wrong(timing):
        right = predict_reload(timing, model.config)
        return check_reload(timing, dataclasses.replace(right, **{side: getattr(right, side) * factor}))

    result = claims.measure_claim(
        "recompute or reload", lambda: time_reload(model, ids, 5), wrong, attempts=3, log=None
    )
    assert not result.holds and result.count == 3
    name = f"{side.removesuffix('_s')}: measured / predicted"
    assert all(name in {c.name for c in attempt.misses} for attempt in result.attempts)
