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

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from kvlab.arch import describe
from kvlab.hardware import Accelerator, Measurement
from kvlab.measure import Timer, percentiles
from kvlab.roofline import REALISM, Realism, StepEstimate, decode_step, realistic_time
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


class _DecodeBench:
    """One decode point made ready to time: `batch_size` sequences with a cache of `context_len - 1` tokens.

    Each `step()` times one single-token forward (so it attends over `context_len`, as
    `kvlab.roofline.decode_step` counts), then crops the cache back so every step sees the same length. Where
    a sliding-window layer is already full the cache cannot be cropped; its full-attention layers then grow by
    one token per step.
    """

    def __init__(self, model: PreTrainedModel, batch_size: int, context_len: int, seed: int) -> None:
        check_count("batch_size", batch_size)
        check_count("context_len", context_len)
        self.model, self.batch_size, self.context_len = model, batch_size, context_len
        self.ids = random_ids(model, batch_size, context_len, seed)
        self.cache = DynamicCache(config=model.config)
        if context_len > 1:
            with torch.inference_mode():
                model(self.ids[:, :-1], cache=self.cache, use_cache=True, logits_to_keep=1)
        # Cropping undoes the step only while no layer has dropped a token: every layer holds the whole context.
        layers = describe(model.config).layers
        self.crop = all(layer.cached_tokens(context_len) == context_len for layer in layers)

    @torch.inference_mode()
    def step(self) -> float:
        with Timer(self.model.device) as timer:
            self.model(self.ids[:, -1:], cache=self.cache, use_cache=True)
        if self.crop:
            self.cache.crop(-1)
        return timer.seconds


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
    check_count("repeat", repeat)
    check_count("warmup", warmup, 0)
    bench = _DecodeBench(model, batch_size, context_len, seed)
    for _ in range(warmup):
        bench.step()
    return StepTiming(batch_size, context_len, tuple(bench.step() for _ in range(repeat)))


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
    """A measured decode step beside its prediction: the roofline bound, plus a fixed per-step overhead when one
    was given (`predicted_s`, from `kvlab.roofline.realistic_time`)."""

    measured: StepTiming
    predicted: StepEstimate
    predicted_s: float | None = None  # None: the bare roofline bound, `predicted.time_s`

    @property
    def prediction_s(self) -> float:
        """Predicted seconds of the step: the realistic time if one was computed, else the roofline bound."""
        return self.predicted.time_s if self.predicted_s is None else self.predicted_s

    @property
    def ratio(self) -> float:
        """Measured median over predicted: 1 is a perfect prediction, above 1 the step is slower than it."""
        return self.measured.median_s / self.prediction_s

    @property
    def best_ratio(self) -> float:
        """Fastest measured step over predicted: the run least disturbed by other work on the machine."""
        return self.measured.best_s / self.prediction_s


def compare_decode(
    model: PreTrainedModel,
    hw: Accelerator | Measurement,
    batch_sizes: Sequence[int],
    context_lens: Sequence[int],
    repeat: int = 5,
    warmup: int = 2,
    *,
    rounds: int = 1,
    realism: Realism | None = None,
) -> list[DecodeComparison]:
    """Time decode steps of `model` at every (batch, context) pair and predict each with `kvlab.roofline`.

    Pass `hw = kvlab.hardware.measure(device)` measured on the same device (and thread count) as the model,
    right before. With `realism` (e.g. `measure_step_overhead(model, hw).realism()`), each prediction is
    `kvlab.roofline.realistic_time`: with a measured `hw`, max(FLOPs / peak, bytes / bandwidth) plus the
    per-step overhead. `rounds` > 1 spreads each point's `repeat` steps over that many passes through all the
    points (every cache stays allocated between passes), so a burst of load from other processes slows one
    round of every point instead of every step of one point; a point's best is then the fastest of
    `rounds × repeat` steps taken at different times.
    """
    check_count("rounds", rounds)
    check_count("repeat", repeat)
    check_count("warmup", warmup, 0)
    benches = [_DecodeBench(model, b, c, seed=0) for b in batch_sizes for c in context_lens]
    for bench in benches:
        for _ in range(warmup):
            bench.step()
    pooled: list[list[float]] = [[] for _ in benches]
    for _ in range(rounds):
        for bench, seconds in zip(benches, pooled, strict=True):
            seconds.extend(bench.step() for _ in range(repeat))
    rows = []
    for bench, seconds in zip(benches, pooled, strict=True):
        step = decode_step(model.config, hw, bench.batch_size, bench.context_len, dtype=model.dtype)
        predicted_s = None if realism is None else realistic_time(step, hw, model.dtype, realism)
        timing = StepTiming(bench.batch_size, bench.context_len, tuple(seconds))
        rows.append(DecodeComparison(timing, step, predicted_s))
    return rows


# --- The fixed per-step overhead, measured ------------------------------------------------------------------------
#
# A decode step launches the same kernels (and runs the same Python) whatever the widths: a model with the same
# layers and heads but tiny widths reads almost no bytes, so its step time is the fixed cost per step. That
# is the term `kvlab.roofline.Realism.step_overhead_s` adds to the bandwidth-and-compute bound; here it is
# measured on the device instead of taken from the calibration figures.

# Width fields shrunk to these values; layer and head counts (what sets the number of kernel launches) are kept.
_HOLLOW_WIDTHS = {
    "head_dim": 8,
    "intermediate_size": 16,
    "moe_intermediate_size": 16,
    "vocab_size": 32,
}


def hollow_config(config: PretrainedConfig) -> PretrainedConfig:
    """`config` with its layers and heads but every width at a few elements: its decode step costs the fixed
    per-step overhead (launches, dispatch, the host loop) and almost no memory traffic."""
    hollow = copy.deepcopy(config.get_text_config(decoder=True))
    heads = getattr(hollow, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"{type(config).__name__} has no num_attention_heads: cannot build its hollow twin")
    for name, value in _HOLLOW_WIDTHS.items():
        if getattr(hollow, name, None) is not None:
            setattr(hollow, name, value)
    hollow.hidden_size = heads * _HOLLOW_WIDTHS["head_dim"]
    return hollow


@dataclass(frozen=True)
class StepOverhead:
    """The measured fixed cost of one decode step on a device."""

    timing: StepTiming  # decode steps of the hollow model at batch 1, context 1
    layers: int
    bound_s: float  # the hollow step's own roofline bound (0 without hardware figures), subtracted

    @property
    def step_s(self) -> float:
        """Seconds per step that neither bandwidth nor compute explains: the fastest hollow step minus its bound.
        The fastest, not the median: other processes on a loaded machine lengthen some steps, never shorten one."""
        return max(self.timing.best_s - self.bound_s, 0.0)

    @property
    def per_layer_s(self) -> float:
        return self.step_s / self.layers

    def realism(self, base: Realism | None = None) -> Realism:
        """The realistic cost model (`kvlab.roofline.realistic_time`) with this measured overhead per step."""
        return replace(REALISM if base is None else base, step_overhead_s=self.step_s)


def measure_step_overhead(
    model: PreTrainedModel,
    hw: Accelerator | Measurement | None = None,
    repeat: int = 20,
    warmup: int = 3,
    seed: int = 0,
) -> StepOverhead:
    """Time decode steps of `model`'s hollow twin (same layers and heads, tiny widths; `hollow_config`) on the
    model's device, dtype and attention implementation. With `hw`, the hollow step's roofline bound is
    subtracted (it is microseconds at most)."""
    config = hollow_config(model.config)
    torch.manual_seed(seed)
    attn = getattr(model.config, "_attn_implementation", None)
    hollow = AutoModelForCausalLM.from_config(config, dtype=model.dtype, attn_implementation=attn)
    torch.nn.Module.to(hollow, model.device)
    hollow.eval()
    timing = measure_decode_step(hollow, 1, 1, repeat=repeat, warmup=warmup, seed=seed)
    bound = decode_step(config, hw, 1, 1, dtype=model.dtype).time_s if hw is not None else 0.0
    return StepOverhead(timing, int(config.num_hidden_layers), bound)


def cpu_load_per_core(device: torch.device) -> float:
    """Runnable processes per core over the last minute (`os.getloadavg`) when timing on a CPU, else 0.

    Above 1, other processes compete with the timed steps for this CPU, and the steps and the ceilings they are
    compared with are measured under different contention; a GPU's kernels are not slowed by host load.
    """
    if device.type != "cpu":
        return 0.0
    return os.getloadavg()[0] / (os.cpu_count() or 1)
