"""Timing real prefill and decode steps of a transformers model with a `DynamicCache`.

These are the measured side of the roofline (`kvlab.roofline`): time to first token against prompt length,
one decode step (the inter-token latency) against context and batch. Inputs are seeded random token ids; the
step time of a dense model does not depend on which tokens they are.

Where measured and predicted part on CPU (see benchmarks/bench_roofline.py): a step also pays a fixed cost
per operator (Python and dispatch, 0.1-0.2 ms per layer on a 2-core CPU), which only weights of a few hundred
MB hide; `DynamicCache` appends with `torch.cat`, so each step copies the whole cache once more on top of the
one read the roofline counts; and skinny matmuls (2 to ~64 rows) run far below both the copy bandwidth and
the square-matmul peak that `kvlab.hardware.measure` reports.
Chapters: *Prefill and decode* (book/03_prefill_decode), *Why decode is bandwidth-bound* (book/04_bandwidth_bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvlab.arch import describe
from kvlab.hardware import Accelerator, Measurement
from kvlab.measure import Timer, percentiles
from kvlab.roofline import StepEstimate, decode_step
from kvlab.sizing import check_count


@dataclass(frozen=True)
class StepTiming:
    batch_size: int
    tokens: int  # context_len for a decode step, prompt_len for a prefill
    seconds: tuple[float, ...]  # one per timed repeat

    @property
    def median_s(self) -> float:
        return percentiles(self.seconds, (50,))["p50"]

    @property
    def best_s(self) -> float:
        return min(self.seconds)


def random_ids(model: PreTrainedModel, batch_size: int, length: int, seed: int) -> torch.Tensor:
    """Seeded token ids on the model's device: a dense model's step time does not depend on which tokens."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (batch_size, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(model.device)


@torch.inference_mode()
def measure_decode_step(
    model: PreTrainedModel,
    batch_size: int = 1,
    context_len: int = 1,
    repeat: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> StepTiming:
    """Seconds of single-token decode steps of `batch_size` sequences over a cache of `context_len` tokens.

    The cache is prefilled with `context_len - 1` tokens; each step appends one (so it attends over
    `context_len`, as `kvlab.roofline.decode_step` counts), then the cache is cropped back so every repeat
    sees the same length. Only the forward pass is timed. Where a sliding-window layer is already full the
    cache cannot be cropped; its full-attention layers then grow by one token per repeat.
    """
    check_count("batch_size", batch_size)
    check_count("context_len", context_len)
    check_count("repeat", repeat)
    check_count("warmup", warmup, 0)
    ids = random_ids(model, batch_size, context_len, seed)
    cache = DynamicCache(config=model.config)
    if context_len > 1:
        model(ids[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
    # Cropping undoes the step only while no layer has dropped a token: every layer still holds the whole context.
    crop = all(layer.cached_tokens(context_len) == context_len for layer in describe(model.config).layers)
    times = []
    for i in range(warmup + repeat):
        with Timer(model.device) as timer:
            model(ids[:, -1:], cache=cache, use_cache=True)
        if crop:
            cache.crop(-1)
        if i >= warmup:
            times.append(timer.seconds)
    return StepTiming(batch_size, context_len, tuple(times))


@torch.inference_mode()
def measure_prefill(
    model: PreTrainedModel,
    batch_size: int = 1,
    prompt_len: int = 1,
    repeat: int = 3,
    warmup: int = 1,
    seed: int = 0,
) -> StepTiming:
    """Seconds to prefill `batch_size` prompts of `prompt_len` tokens into a fresh cache (logits of the last
    token only, as generation computes them): the time to first token without queueing or sampling."""
    check_count("batch_size", batch_size)
    check_count("prompt_len", prompt_len)
    check_count("repeat", repeat)
    check_count("warmup", warmup, 0)
    ids = random_ids(model, batch_size, prompt_len, seed)
    times = []
    for i in range(warmup + repeat):
        cache = DynamicCache(config=model.config)
        with Timer(model.device) as timer:
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        if i >= warmup:
            times.append(timer.seconds)
        del cache
    return StepTiming(batch_size, prompt_len, tuple(times))


@dataclass(frozen=True)
class DecodeComparison:
    """A measured decode step beside its roofline prediction."""

    measured: StepTiming
    predicted: StepEstimate

    @property
    def ratio(self) -> float:
        """Measured median over predicted: 1 is a perfect roofline, above 1 the step is slower than it."""
        return self.measured.median_s / self.predicted.time_s


def compare_decode(
    model: PreTrainedModel,
    hw: Accelerator | Measurement,
    batch_sizes: Sequence[int],
    context_lens: Sequence[int],
    repeat: int = 5,
    warmup: int = 2,
) -> list[DecodeComparison]:
    """Time decode steps of `model` at every (batch, context) pair and predict each with `kvlab.roofline`.

    Pass `hw = kvlab.hardware.measure(device)` measured on the same device (and thread count) as the model.
    """
    rows = []
    for batch in batch_sizes:
        for context in context_lens:
            measured = measure_decode_step(model, batch, context, repeat=repeat, warmup=warmup)
            predicted = decode_step(model.config, hw, batch, context, dtype=model.dtype)
            rows.append(DecodeComparison(measured, predicted))
    return rows
