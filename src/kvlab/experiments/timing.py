"""Timing real prefill and decode steps of a transformers model with a `DynamicCache`.

These are the measured side of the roofline (`kvlab.costs.roofline`): time to first token against prompt length,
one decode step (the inter-token latency) against context and batch. Inputs are seeded random token ids; the
step time of a dense model does not depend on which tokens they are.

Where measured and predicted part on CPU (see benchmarks/bench_roofline.py): a step also pays a fixed cost
per operator (Python and dispatch, 0.1-0.2 ms per layer on a 2-core CPU), which only weights of a few hundred
MB hide; `DynamicCache` appends with `torch.cat`, so each step copies the whole cache once more on top of the
one read the roofline counts (`predict_bench_step` adds it); and skinny matmuls (2 to ~64 rows) run far below
both the copy bandwidth and the square-matmul peak that `kvlab.specs.hardware.measure` reports.

The labs' timing claims are measured claims (`kvlab.claims.measure_claim`): `sweep_prefill` and `sweep_decode`
take one whole measurement, interleaved in rounds with the ceilings it is predicted from, and `check_prefill`,
`check_context_growth` and `check_roofline` decide it; `prediction_floor` derives the lowest measured/predicted
a true prediction allows.
Chapters: *Prefill and decode* (book/03_prefill_decode), *Why decode is bandwidth-bound* (book/04_bandwidth_bound).
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from kvlab.checks import check_count
from kvlab.claims import Check, between, less
from kvlab.costs.roofline import (
    REALISM,
    Realism,
    StepEstimate,
    critical_batch_size,
    decode_step,
    prefill,
    realistic_time,
)
from kvlab.measure import Timer, percentiles, step_clock
from kvlab.specs import hardware
from kvlab.specs.arch import describe
from kvlab.specs.hardware import Accelerator, Measurement
from kvlab.specs.sizing import weight_bytes


@dataclass(frozen=True)
class StepTiming:
    batch_size: int
    # context_len for a decode step, prompt_len for a prefill
    tokens: int
    # One per timed repeat
    seconds: tuple[float, ...]

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
    `kvlab.costs.roofline.decode_step` counts), then crops the cache back so every step sees the same length. Where
    a sliding-window layer is already full the cache cannot be cropped; its full-attention layers then grow by
    one token per step.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        batch_size: int,
        context_len: int,
        seed: int,
        clock: Callable[[], float] | None = None,
    ) -> None:
        check_count("batch_size", batch_size)
        check_count("context_len", context_len)
        self.model, self.batch_size, self.context_len, self.clock = model, batch_size, context_len, clock
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
        with Timer(self.model.device, clock=self.clock) as timer:
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
    `context_len`, as `kvlab.costs.roofline.decode_step` counts), then the cache is cropped back so every repeat
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
    times = [_prefill_once(model, ids) for _ in range(warmup + repeat)]
    return StepTiming(batch_size, prompt_len, tuple(times[warmup:]))


@torch.inference_mode()
def _prefill_once(
    model: PreTrainedModel, ids: torch.Tensor, clock: Callable[[], float] | None = None
) -> float:
    """Seconds of one prefill of `ids` into a fresh cache, in one forward pass (logits of the last token only)."""
    cache = DynamicCache(config=model.config)
    with Timer(model.device, clock=clock) as timer:
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    return timer.seconds


def append_copy_bytes(step: StepEstimate) -> float:
    """Bytes a `DynamicCache` moves to append one token per sequence, beyond the read the roofline counts:
    `torch.cat` reads the whole cache and writes it anew, 2 × the step's KV bytes (read + written, as
    `kvlab.specs.hardware.measure` counts a copy). A paged engine writes one slot instead; the benches here time the
    `DynamicCache` transformers generates with, so their prediction includes it."""
    return 2 * step.kv_bytes


def predict_bench_step(
    step: StepEstimate, hw: Accelerator | Measurement, dtype: torch.dtype, realism: Realism
) -> float:
    """Predicted seconds of a decode step as this module times it: `kvlab.costs.roofline.realistic_time` (the larger
    of compute and memory terms, plus the per-step overhead) plus the cache's append copy at the bandwidth."""
    measured = isinstance(hw, Measurement)
    bandwidth = hw.bandwidth_bytes_per_s * (1.0 if measured else realism.bandwidth_efficiency)
    return realistic_time(step, hw, dtype, realism) + append_copy_bytes(step) / bandwidth


@dataclass(frozen=True)
class DecodeComparison:
    """A measured decode step beside its prediction: the roofline bound, or with a per-step overhead given the
    bench's realistic prediction (`predicted_s`, from `predict_bench_step`)."""

    measured: StepTiming
    predicted: StepEstimate
    # None: the bare roofline bound, `predicted.time_s`
    predicted_s: float | None = None
    # The fixed per-step cost inside `predicted_s`
    overhead_s: float = 0.0
    # How far the hollow twin's steps spread above their fastest (`StepOverhead.spread_s`)
    overhead_spread_s: float = 0.0

    @property
    def prediction_s(self) -> float:
        """Predicted seconds of the step: the realistic time if one was computed, else the roofline bound."""
        return self.predicted.time_s if self.predicted_s is None else self.predicted_s

    @property
    def work_s(self) -> float:
        """The predicted seconds of the step's own work: the prediction less the fixed per-step overhead (the
        roofline bound, plus the cache's append copy in a realistic prediction)."""
        return self.prediction_s - self.overhead_s

    @property
    def ratio(self) -> float:
        """Measured median over predicted: 1 is a perfect prediction, above 1 the step is slower than it."""
        return self.measured.median_s / self.prediction_s

    @property
    def best_ratio(self) -> float:
        """Fastest measured step over predicted: the run least disturbed by other work on the machine."""
        return self.measured.best_s / self.prediction_s


def _compare(
    config: PretrainedConfig,
    dtype: torch.dtype,
    hw: Accelerator | Measurement,
    timing: StepTiming,
    realism: Realism | None,
) -> DecodeComparison:
    step = decode_step(config, hw, timing.batch_size, timing.tokens, dtype=dtype)
    if realism is None:
        return DecodeComparison(timing, step)
    predicted = predict_bench_step(step, hw, dtype, realism)
    return DecodeComparison(timing, step, predicted, realism.step_overhead_s)


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
    """Time decode steps of `model` at every (batch, context) pair and predict each with `kvlab.costs.roofline`.

    Pass `hw = kvlab.specs.hardware.measure(device)` measured on the same device (and thread count) as the model,
    right before (`sweep_decode` measures the ceilings between the steps instead). With `realism` (e.g.
    `measure_step_overhead(model, hw).realism()`), each prediction is `predict_bench_step`: with a measured
    `hw`, max(FLOPs / peak, bytes / bandwidth) plus the per-step overhead plus the cache's append copy.
    `rounds` > 1 spreads each point's `repeat` steps over that many passes through all the points (every cache
    stays allocated between passes), so a burst of load from other processes slows one round of every point
    instead of every step of one point; a point's best is then the fastest of `rounds × repeat` steps taken at
    different times.
    """
    check_count("rounds", rounds)
    check_count("repeat", repeat)
    check_count("warmup", warmup, 0)
    benches = [_DecodeBench(model, b, c, seed=0) for b in batch_sizes for c in context_lens]
    pooled = _time_in_rounds(benches, repeat, warmup, rounds)
    return [_compare(model.config, model.dtype, hw, timing, realism) for timing in pooled]


def _time_in_rounds(
    benches: Sequence[_DecodeBench],
    repeat: int,
    warmup: int,
    rounds: int,
    between_rounds: Sequence[Callable[[], object]] = (),
) -> list[StepTiming]:
    """`repeat` steps of every bench per round, `rounds` times, after `warmup` steps each; `between_rounds`
    (other measurements, such as the ceilings) run at the start of every round."""
    for bench in benches:
        for _ in range(warmup):
            bench.step()
    pooled: list[list[float]] = [[] for _ in benches]
    for _ in range(rounds):
        for measure in between_rounds:
            measure()
        for bench, seconds in zip(benches, pooled, strict=True):
            seconds.extend(bench.step() for _ in range(repeat))
    return [
        StepTiming(bench.batch_size, bench.context_len, tuple(seconds))
        for bench, seconds in zip(benches, pooled, strict=True)
    ]


# --- The fixed per-step overhead, measured ------------------------------------------------------------------------
#
# A decode step launches the same kernels (and runs the same Python) whatever the widths: a model with the same
# layers and heads but tiny widths reads almost no bytes, so its step time is the fixed cost per step. That
# is the term `kvlab.costs.roofline.Realism.step_overhead_s` adds to the bandwidth-and-compute bound; here it is
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

    # Decode steps of the hollow model at batch 1, context 1
    timing: StepTiming
    layers: int
    # The hollow step's own roofline bound (0 without hardware figures), subtracted
    bound_s: float

    @property
    def step_s(self) -> float:
        """Seconds per step that neither bandwidth nor compute explains: the fastest hollow step minus its bound.
        The fastest, not the median: other processes on a loaded machine lengthen some steps, never shorten one."""
        return max(self.timing.best_s - self.bound_s, 0.0)

    @property
    def spread_s(self) -> float:
        """How far the hollow steps spread: their median less their fastest. A step that launches the same
        kernels can come in this much under the hollow twin's fastest by chance."""
        return self.timing.median_s - self.timing.best_s

    @property
    def per_layer_s(self) -> float:
        return self.step_s / self.layers

    def realism(self, base: Realism | None = None) -> Realism:
        """The realistic cost model (`kvlab.costs.roofline.realistic_time`) with this measured overhead per step."""
        return replace(REALISM if base is None else base, step_overhead_s=self.step_s)


def _hollow_twin(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """`model`'s hollow twin (`hollow_config`) on its device, dtype and attention implementation."""
    config = hollow_config(model.config)
    torch.manual_seed(seed)
    attn = getattr(model.config, "_attn_implementation", None)
    hollow = AutoModelForCausalLM.from_config(config, dtype=model.dtype, attn_implementation=attn)
    torch.nn.Module.to(hollow, model.device)
    return hollow.eval()


def _overhead(
    hollow: PreTrainedModel, timing: StepTiming, hw: Accelerator | Measurement | None
) -> StepOverhead:
    config = hollow.config
    bound = decode_step(config, hw, 1, 1, dtype=hollow.dtype).time_s if hw is not None else 0.0
    return StepOverhead(timing, int(config.num_hidden_layers), bound)


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
    hollow = _hollow_twin(model, seed)
    timing = measure_decode_step(hollow, 1, 1, repeat=repeat, warmup=warmup, seed=seed)
    return _overhead(hollow, timing, hw)


# --- Measured claims: the whole measurement of a claim, and its checks (`kvlab.claims.measure_claim`) -------------
#
# Each `sweep_*` takes one fresh measurement of everything a claim compares, interleaved in rounds so that a burst
# of load from other processes slows one round of every quantity instead of all of one; each `check_*` turns it
# into `kvlab.claims.Check`s. A lab runs them as `claims.measure_claim(name, measure, check, attempts)`.

# How much faster than a copy's counted rate a step can move its bytes. `kvlab.specs.hardware.measure` counts a copy's
# read and write (STREAM's convention), but a CPU cache also reads every destination line before writing it
# (write-allocate), so the copy moves 3 bytes for each 2 it counts and a step that only reads can beat the
# counted rate by up to 3/2 (https://www.cs.virginia.edu/stream/ref.html, "counting bytes"). A GPU has no
# write-allocate; its reads beat its copies by less, so 3/2 bounds both. On a CPU the sweep predicts from a
# matrix-vector product's read rate for the weights (`sweep_decode`): the step's own linear maps read within a
# fifth of it (13-16 GB/s across a model's four shapes, AMD EPYC), well inside the same 3/2.
READ_SPEEDUP = 1.5


def prediction_floor(row: DecodeComparison, on_cpu: bool, read_speedup: float = READ_SPEEDUP) -> float:
    """The lowest measured/predicted a true realistic prediction allows for `row`: its work (`row.work_s`) done
    up to `read_speedup` times faster than predicted, and the fixed overhead paid in full. On a CPU the host
    runs every operator in turn, so the two add; on a GPU the host launches while earlier kernels run, so the
    step takes at least the larger of the two.

    A launch-bound GPU step is the hollow twin's step plus a little work, so the larger of the two reduces to
    "the model's fastest step is no faster than the hollow twin's fastest": a coin flip between two samples of
    one distribution. There the overhead counts less the hollow steps' own spread (`StepOverhead.spread_s`), so
    the floor rejects a step faster than the launches by more than their noise (a clock that misses the
    kernels), not one that drew a faster sample. A CPU step is timed in its thread's CPU time and adds its work
    to the overhead, so its floor keeps the overhead whole."""
    work, overhead = row.work_s / read_speedup, row.overhead_s
    if on_cpu:
        fastest = work + overhead
    else:
        fastest = max(work, overhead - row.overhead_spread_s)
    return fastest / row.prediction_s


def prediction_band(row: DecodeComparison, on_cpu: bool, ratio_high: float) -> Check:
    """measured (fastest step) / predicted within [`prediction_floor`, `ratio_high`]."""
    name = f"batch {row.measured.batch_size}, context {row.measured.tokens}: measured/predicted"
    return between(name, row.best_ratio, prediction_floor(row, on_cpu), ratio_high)


# The band a true prediction's work keeps, as the median over the batch-1 steps of (fastest step - overhead)
# / predicted work (`work_ratio`). A prediction with its bandwidth or its bytes 2x wrong scales every work ratio
# by 2 or 1/2; a band narrower than 2x (`work_band` refuses a wider one) holds the true and the wrong apart.
# The median runs over every round and context, each round's steps against that round's own ceilings
# (`DecodeSweep.paired_rows`): on a 2-core AMD EPYC, quiet and loaded, 40 attempts of each of chapters 3 and 4 ran
# 0.90-1.41, where the fastest of the whole sweep had spread chapter 3's over 0.88-1.78
# (benchmarks/results/decode-band-*.json). The median, not each one, because a small model's step is mostly fixed
# overhead and one context's work ratio carries all of that overhead's noise. The per-step band
# (`prediction_band`) stays, at every context, for what it rejects: a step faster than its work and overhead allow.
WORK_BAND = (0.8, 1.5)
# On a GPU, only steps whose predicted work is at least this many times the overhead enter the median:
# below, a step is launches, and its work ratio is noise over a tiny denominator.
WORK_BAND_DOMINANCE = 3.0


def work_ratio(row: DecodeComparison) -> float:
    """(Fastest step - fixed overhead) / predicted work: how fast the step did the work the roofline predicts."""
    return (row.measured.best_s - row.overhead_s) / row.work_s


def median_work_ratio(
    rows: Sequence[DecodeComparison], on_cpu: bool, dominance: float = WORK_BAND_DOMINANCE
) -> float | None:
    """The median `work_ratio` of `rows`; on a GPU only of the work-bound ones (None: there are none)."""
    held = list(rows) if on_cpu else [r for r in rows if r.work_s >= dominance * r.overhead_s]
    return statistics.median(work_ratio(r) for r in held) if held else None


def work_band(
    rows: Sequence[DecodeComparison],
    on_cpu: bool,
    dominance: float = WORK_BAND_DOMINANCE,
    band: tuple[float, float] = WORK_BAND,
) -> Check:
    """The median work ratio of `rows` (`median_work_ratio`; the labs pass `DecodeSweep.paired_rows`) within
    `band`: what rejects a roofline 2x wrong either way, so a band 2x wide or wider is refused. On a GPU with no
    work-bound row, the check says so and holds (the regime line reports it)."""
    low, high = band
    if not 0 < low < high < 2 * low:
        raise ValueError(
            f"work band {band!r}: need 0 < low < high < 2 x low, or a 2x wrong roofline could pass"
        )
    name = "batch 1: median of (step - overhead) / predicted work"
    median = median_work_ratio(rows, on_cpu, dominance)
    if median is None:
        return Check(name, True, f"not checked: no step's work is {dominance:g}x its overhead (launch-bound)")
    return between(name, median, low, high)


def probe_bytes(model: PreTrainedModel, cap: int = 256 * 2**20) -> int:
    """Size of the copy that measures the bandwidth a step of `model` sees: its weights' bytes (at least 1 MiB,
    at most `cap`), so the copy's buffers and the step's reads live in the same level of memory: the last-level
    cache of a CPU for a model that fits there, DRAM or HBM otherwise."""
    return int(min(max(weight_bytes(model.config, model.dtype), 2**20), cap)) // 4 * 4


@dataclass(frozen=True)
class DecodeSweep:
    """Decode steps timed in rounds beside the ceilings and the fixed overhead they are predicted from."""

    # Bandwidth: the fastest probe copy over the whole sweep
    hw: Measurement
    # Hollow-twin steps, a few in every round
    overhead: StepOverhead
    rows: tuple[DecodeComparison, ...]
    config: PretrainedConfig = field(repr=False)
    dtype: torch.dtype
    on_cpu: bool
    # The model's linear maps at each measured batch over at batch 1 (`kvlab.specs.hardware.LinearProbe`): what
    # reading the weights once costs this device at that batch, in matrix-vector products
    read_cost: Mapping[int, float]
    # Per round, every point's steps of that round against that round's own ceilings and hollow steps
    round_rows: tuple[tuple[DecodeComparison, ...], ...]

    def row(self, batch_size: int, context_len: int) -> DecodeComparison:
        return _find(self.rows, batch_size, context_len)

    def at_contexts(self, contexts: Sequence[int], batch_size: int = 1) -> list[DecodeComparison]:
        return [self.row(batch_size, c) for c in contexts]

    def paired_rows(self, contexts: Sequence[int], batch_size: int = 1) -> list[DecodeComparison]:
        """Every round's steps at `contexts`, each predicted from the ceilings and overhead timed in its own
        round: what the work band's median is taken over (`work_band`)."""
        return [_find(rows, batch_size, c) for rows in self.round_rows for c in contexts]

    def at_batches(self, batch_sizes: Sequence[int], context_len: int) -> list[DecodeComparison]:
        return [self.row(b, context_len) for b in batch_sizes]


def _find(rows: Sequence[DecodeComparison], batch_size: int, context_len: int) -> DecodeComparison:
    for r in rows:
        if (r.measured.batch_size, r.measured.tokens) == (batch_size, context_len):
            return r
    raise KeyError(f"no measured point at batch {batch_size}, context {context_len}")


def decode_points(
    contexts: Sequence[int], batch_sizes: Sequence[int] = (), batch_context: int = 1
) -> list[tuple[int, int]]:
    """(batch, context) points: every context at batch 1, then every batch at `batch_context`, each once."""
    points = [(1, c) for c in contexts] + [(b, batch_context) for b in batch_sizes]
    return list(dict.fromkeys(points))


def sweep_decode(
    model: PreTrainedModel,
    points: Sequence[tuple[int, int]],
    repeat: int = 3,
    rounds: int = 5,
    warmup: int = 2,
    *,
    copy_bytes: int | None = None,
    hw_repeat: int = 5,
    seed: int = 0,
) -> DecodeSweep:
    """One measurement of decode steps against their realistic prediction, everything interleaved.

    Everything is read with `kvlab.measure.step_clock` (a CPU thread's CPU time on one torch thread, so that the
    moments another process holds the core are not counted). The ceilings are measured first
    (`kvlab.specs.hardware.measure`); then each of `rounds` rounds times one copy of
    `copy_bytes` (default `probe_bytes(model)`), one square matmul (the peak), `repeat` passes of the model's
    linear maps at every measured batch (`hardware.LinearProbe`, on weights of its shapes within the same bytes),
    then `repeat` steps of the hollow twin (the fixed overhead) and of every (batch, context) point. Each
    quantity is the fastest over all rounds (noise only ever adds time), and each step is predicted by
    `predict_bench_step`. Each round is also kept apart (`DecodeSweep.paired_rows`): its steps against its own
    ceilings and hollow steps, what the work band is checked on.

    The roofline reads the cache at the copy's bandwidth. It reads the weights at the same rate on a GPU, whose
    memory system sets it; on a CPU at the linear maps' read rate at batch 1 (`hw.weight_read_bytes_per_s`).
    There the host runs each kernel in turn, and a matrix-vector product can read at little more than half the
    rate a copy moves bytes (torch 2.13's MKL on AMD EPYC), while attention streams the cache near the copy's.
    """
    check_count("repeat", repeat)
    check_count("rounds", rounds)
    check_count("warmup", warmup, 0)
    device, dtype, clock = model.device, model.dtype, step_clock(model.device)
    probe = hardware.CopyProbe(device, probe_bytes(model) if copy_bytes is None else copy_bytes, clock)
    matmul = hardware.MatmulProbe(device, 8192 if device.type == "cuda" else 1024, dtype, clock)
    peak = hardware.measure(device, repeat=hw_repeat, probe=probe, matmul_probe=matmul)
    weights = hardware.linear_weights(linear_shapes(model), probe.nbytes, dtype, device)
    reads = {b: hardware.LinearProbe(weights, b, clock) for b in sorted({1, *(b for b, _ in points)})}
    hollow = _hollow_twin(model, seed)
    benches = [
        _DecodeBench(m, b, c, seed, clock) for m, b, c in [(hollow, 1, 1), *((model, *p) for p in points)]
    ]
    on_cpu = device.type == "cpu"
    per_round: list[Measurement] = []

    def ceilings() -> None:
        # as many passes of the linear maps per round as steps of a point: their fastest is the bandwidth on a
        # CPU, and a best of fewer samples would sit higher in the noise than the steps it predicts
        copy_s, matmul_s = probe.time(), matmul.time()
        read_s = {b: r.time(repeat) for b, r in reads.items()}
        per_round.append(
            replace(
                peak,
                bandwidth_bytes_per_s=probe.bandwidth_at(copy_s),
                flops=matmul.flops_at(matmul_s),
                weight_read_bytes_per_s=reads[1].read_rate_at(read_s[1]) if on_cpu else None,
            )
        )

    timings = _time_in_rounds(benches, repeat, warmup, rounds, [ceilings])
    weight_rate = reads[1].read_bytes_per_s if on_cpu else None
    hw = replace(
        peak,
        bandwidth_bytes_per_s=probe.bandwidth_bytes_per_s,
        flops=matmul.flops,
        weight_read_bytes_per_s=weight_rate,
    )
    overhead = _overhead(hollow, timings[0], hw)
    realism = overhead.realism()
    rows = tuple(
        replace(_compare(model.config, dtype, hw, timing, realism), overhead_spread_s=overhead.spread_s)
        for timing in timings[1:]
    )
    read_cost = {b: r.fastest_s() / reads[1].fastest_s() for b, r in reads.items()}
    round_rows = tuple(
        _round_rows(model.config, dtype, round_hw, [_in_round(t, k, repeat) for t in timings], overhead)
        for k, round_hw in enumerate(per_round)
    )
    return DecodeSweep(hw, overhead, rows, model.config, dtype, on_cpu, read_cost, round_rows)


def _in_round(timing: StepTiming, k: int, repeat: int) -> StepTiming:
    """The `repeat` steps `timing` took in round `k` (`_time_in_rounds` keeps them in round order)."""
    return replace(timing, seconds=timing.seconds[k * repeat : (k + 1) * repeat])


def _round_rows(
    config: PretrainedConfig,
    dtype: torch.dtype,
    hw: Measurement,
    timings: Sequence[StepTiming],
    overhead: StepOverhead,
) -> tuple[DecodeComparison, ...]:
    """One round's points (`timings[1:]`) predicted from that round's ceilings `hw` and its hollow steps
    (`timings[0]`). Drift between rounds (a core's clock, a neighbour on the memory bus) then moves a step and
    its prediction together; the fastest over the whole sweep can pair a step and a ceiling from different
    moments (`benchmarks/decode_band_attempts.py` measured both)."""
    realism = replace(overhead, timing=timings[0]).realism()
    return tuple(_compare(config, dtype, hw, t, realism) for t in timings[1:])


def linear_shapes(model: PreTrainedModel) -> list[tuple[int, int]]:
    """(out, in) of every linear map of `model`, in the order its modules are registered (layer by layer)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return [(int(m.weight.shape[0]), int(m.weight.shape[1])) for m in linears]


def shared_read_cost(sweep: DecodeSweep, batch_size: int) -> float:
    """What reading the weights once costs at `batch_size`, in batch-1 reads: this device's matmul at that many
    rows over its matrix-vector product (`DecodeSweep.read_cost`), at least 1."""
    return max(sweep.read_cost[batch_size], 1.0)


def batch_cost_bound(sweep: DecodeSweep, batch_size: int) -> float:
    """The most batch-1 steps a batch of `batch_size` may cost (`batch_cost`)."""
    return math.sqrt(batch_size * shared_read_cost(sweep, batch_size))


def batch_cost(sweep: DecodeSweep, batch_size: int, batch_context: int) -> Check:
    """Batch `batch_size` at `batch_context` tokens costs fewer batch-1 steps than the geometric midpoint of
    two costs: the weights read once for the whole batch, as this device's matmul reads them at that batch
    (`DecodeSweep.read_cost`, at least 1), and the weights read once per sequence (`batch_size`). The midpoint
    is as far, in ratio, from either: a step that shares its reads lands near the first, one that does not
    near the second."""
    one, many = sweep.row(1, batch_context), sweep.row(batch_size, batch_context)
    cost = many.measured.best_s / one.measured.best_s
    shared, bound = shared_read_cost(sweep, batch_size), batch_cost_bound(sweep, batch_size)
    detail = (
        f"{cost:.2f} < {bound:.2f}: between {shared:.2f} (weights read once, at this device's "
        f"{batch_size}-row matmul rate) and {batch_size} (read once per sequence)"
    )
    return Check(f"batch {batch_size} in batch-1 steps", cost < bound, detail)


def _ratio_band(rows: Sequence[DecodeComparison], on_cpu: bool, ratio_high: float | None) -> list[Check]:
    """`prediction_band` at every row, or only its lower end where `ratio_high` is None."""
    if ratio_high is not None:
        return [prediction_band(r, on_cpu, ratio_high) for r in rows]
    return [prediction_band(r, on_cpu, math.inf) for r in rows]


def _check_batch_one(batch_sizes: Sequence[int]) -> None:
    if not batch_sizes or batch_sizes[0] != 1:
        raise ValueError(f"batch_sizes must start at 1 (the reference step), got {list(batch_sizes)}")


def check_context_growth(
    sweep: DecodeSweep,
    contexts: Sequence[int],
    batch_sizes: Sequence[int],
    batch_context: int,
    *,
    min_predicted_growth: float,
    ratio_high: float,
    band: tuple[float, float] = WORK_BAND,
) -> list[Check]:
    """The claims of *Prefill and decode* on one sweep: at every batch-1 context the step within its band
    (`prediction_band`), and their median work within `band` (`work_band`); on a CPU, sizes at which the step is predicted to grow at least `min_predicted_growth`
    from the shortest to the longest context (or CI would never check the growth); where it is, the measured
    step grows by at least half the predicted extra time; and the largest batch shares its weight reads
    (`batch_cost`)."""
    _check_batch_one(batch_sizes)
    rows = sweep.at_contexts(contexts)
    checks = _ratio_band(rows, sweep.on_cpu, ratio_high)
    checks.append(work_band(sweep.paired_rows(contexts), sweep.on_cpu, band=band))
    predicted = rows[-1].prediction_s / rows[0].prediction_s
    shows = predicted >= min_predicted_growth
    if sweep.on_cpu:
        checks.append(
            Check(
                "the CPU sizes show the growth",
                shows,
                f"predicted {predicted:.2f}x from {contexts[0]} to {contexts[-1]} tokens, "
                f"needs {min_predicted_growth:g}x",
            )
        )
    if shows:
        floor = 1 + (predicted - 1) / 2
        growth = rows[-1].measured.best_s / rows[0].measured.best_s
        checks.append(
            Check(
                "the step grows with the context",
                growth > floor,
                f"measured {growth:.2f}x > {floor:.2f}x (half the predicted extra time)",
            )
        )
    checks.append(batch_cost(sweep, batch_sizes[-1], batch_context))
    return checks


def check_roofline(
    sweep: DecodeSweep,
    contexts: Sequence[int],
    batch_sizes: Sequence[int],
    batch_context: int,
    *,
    dominance: float,
    ratio_high: float,
    band: tuple[float, float] = WORK_BAND,
) -> list[Check]:
    """The claims of *Why decode is bandwidth-bound* on one sweep: at every batch-1 context the step within its
    band (`prediction_band`), their median work within `band` (`work_band`), and the steps whose work is at least `dominance` × the overhead (bandwidth-bound)
    memory-bound on the roofline; on a CPU at least one such step (or CI would never check the claim); at every
    larger batch with such work, the lower end of the band (skinny matmuls may run slower, never much faster); and the
    largest measured batch below the device's critical batch shares its weight reads (`batch_cost`)."""
    _check_batch_one(batch_sizes)
    single = sweep.at_contexts(contexts)
    checks = _ratio_band(single, sweep.on_cpu, ratio_high)
    checks.append(work_band(sweep.paired_rows(contexts), sweep.on_cpu, dominance, band))
    overhead = sweep.overhead.step_s
    held = [r for r in single if r.work_s >= dominance * overhead]
    checks += [
        Check(f"context {r.measured.tokens}: memory-bound on the roofline", r.predicted.bound == "memory")
        for r in held
    ]
    if sweep.on_cpu:
        largest = max(r.work_s for r in single)
        detail = f"largest work {largest * 1e3:.2f} ms, overhead {overhead * 1e3:.2f} ms"
        checks.append(Check(f"a batch-1 step with work >= {dominance:g}x the overhead", bool(held), detail))
    batched = sweep.at_batches(batch_sizes, batch_context)
    worked = [r for r in batched[1:] if r.work_s >= dominance * overhead]
    checks += _ratio_band(worked, sweep.on_cpu, None)
    critical = critical_batch_size(sweep.config, sweep.hw, batch_context, dtype=sweep.dtype)
    below = [r for r in batched if 1 < r.measured.batch_size <= (critical or math.inf)]
    checks.append(Check("a measured batch below the critical batch", bool(below), f"critical {critical}"))
    if below:
        checks.append(batch_cost(sweep, below[-1].measured.batch_size, batch_context))
    return checks


# --- Prefill against the prompt length (chapter *Prefill and decode*) --------------------------------------------


# A prefill whose predicted work is this many times the fixed cost of a forward is mostly work (as
# `kvlab.experiments.decode.WORK_DOMINATES` for a step): the second-longest prompt at 8x the overhead makes the
# longest grow at least 17x over the shortest (the claim asks 8x) and the last two grow 1.9x for 2x the tokens
# (3.7x for 4x; the claim asks 0.75 of it), even if the overhead is not hidden at all.
PREFILL_DOMINANCE = 8


@dataclass(frozen=True)
class PrefillSweep:
    """Prefills of every prompt length and single-token decode steps at the shortest, timed in rounds; with the
    fixed cost of a forward (the hollow twin's prefill of the shortest prompt) and each prompt's predicted work
    (`kvlab.costs.roofline.prefill` at the ceilings measured in the same rounds), which decide the regime."""

    prefills: tuple[StepTiming, ...]
    # Decode steps at the shortest prompt's length
    step: StepTiming
    # Prefills of the shortest prompt by the hollow twin (`hollow_config`): the fixed cost; None: not measured
    overhead: StepTiming | None = None
    # Prompt length -> the roofline's prefill time at the measured ceilings: the work
    work_s: Mapping[int, float] = field(default_factory=dict)
    on_cpu: bool = True
    # The hollow twin's own predicted work, subtracted from its time (as `StepOverhead` does for a step)
    overhead_work_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        """The fixed cost of a forward: the hollow twin's fastest prefill less its own predicted work."""
        if self.overhead is None:
            raise ValueError("this prefill sweep measured no fixed cost")
        return max(self.overhead.best_s - self.overhead_work_s, 1e-12)

    def dominance(self) -> float:
        """The second-longest prompt's predicted work over the fixed cost: how much the long end is work."""
        return self.work_s[self.prompt_lens[-2]] / self.overhead_s

    def work_bound(self, dominance: float = PREFILL_DOMINANCE) -> bool:
        """Whether the long end is work, not launches (True where no fixed cost was measured)."""
        return self.overhead is None or self.dominance() >= dominance

    def regime(self, dominance: float = PREFILL_DOMINANCE) -> str:
        """Which regime the sweep is in, in one line."""
        if self.overhead is None:
            return "regime not measured"
        second, ratio = self.prompt_lens[-2], self.dominance()
        if ratio >= dominance:
            return f"work-bound: the {second:,}-token prefill's predicted work is {ratio:.0f}x the fixed cost"
        return (
            f"launch-bound at these sizes: the {second:,}-token prefill's predicted work is {ratio:.2g}x the "
            f"fixed cost (the growth claims need {dominance:g}x)"
        )

    @property
    def prompt_lens(self) -> list[int]:
        return [p.tokens for p in self.prefills]

    @property
    def ttft(self) -> dict[int, float]:
        """Fastest prefill per prompt length: the time to first token without queueing or sampling."""
        return {p.tokens: p.best_s for p in self.prefills}

    @property
    def growth(self) -> float:
        """TTFT of the longest prompt over the shortest's."""
        first, *_, last = self.prefills
        return last.best_s / first.best_s

    @property
    def cheapest(self) -> int:
        """The prompt length with the lowest TTFT per prompt token."""
        return min(self.prompt_lens, key=lambda p: self.ttft[p] / p)

    @property
    def last_growth(self) -> float:
        """TTFT of the longest prompt over the second longest's."""
        return self.prefills[-1].best_s / self.prefills[-2].best_s

    @property
    def at_once(self) -> float:
        """The longest prefill over as many single-token decode steps: below 1, the prompt at once is faster."""
        return self.prefills[-1].best_s / (self.prefills[-1].tokens * self.step.best_s)


def sweep_prefill(
    model: PreTrainedModel,
    prompt_lens: Sequence[int],
    repeat: int = 1,
    rounds: int = 3,
    step_repeat: int = 3,
    seed: int = 0,
) -> PrefillSweep:
    """Time a prefill of every prompt length (`_prefill_once`: one forward pass into a fresh cache) `repeat`
    times per round, and `step_repeat` decode steps at the shortest length, in each of `rounds` rounds, after
    one untimed prefill each (the warm-up); read with `kvlab.measure.step_clock`.

    Each round also times the hollow twin's prefill of the shortest prompt (the fixed cost of a forward), a copy
    of the weights' size and a square matmul (the ceilings, as `sweep_decode` does), from which each prompt's
    work is predicted (`kvlab.costs.roofline.prefill`): `check_prefill` holds the growth claims only where the
    work outweighs the fixed cost."""
    check_count("rounds", rounds)
    check_count("repeat", repeat)
    if len(prompt_lens) < 3 or list(prompt_lens) != sorted(set(prompt_lens)):
        raise ValueError(f"prompt_lens must be at least 3 increasing lengths, got {list(prompt_lens)}")
    device, clock = model.device, step_clock(model.device)
    ids = {p: random_ids(model, 1, p, seed) for p in prompt_lens}
    hollow = _hollow_twin(model, seed)
    short = random_ids(hollow, 1, prompt_lens[0], seed)
    probe = hardware.CopyProbe(device, probe_bytes(model), clock)
    matmul = hardware.MatmulProbe(device, 8192 if device.type == "cuda" else 1024, model.dtype, clock)
    for p in prompt_lens:
        _prefill_once(model, ids[p], clock)
    _prefill_once(hollow, short, clock)
    step = _DecodeBench(model, 1, prompt_lens[0], seed, clock)
    step.step()
    seconds: dict[int, list[float]] = {p: [] for p in prompt_lens}
    steps: list[float] = []
    fixed: list[float] = []
    for _ in range(rounds):
        probe.time()
        matmul.time()
        fixed.append(_prefill_once(hollow, short, clock))
        steps.extend(step.step() for _ in range(step_repeat))
        for p in prompt_lens:
            seconds[p].extend(_prefill_once(model, ids[p], clock) for _ in range(repeat))
    prefills = tuple(StepTiming(1, p, tuple(seconds[p])) for p in prompt_lens)
    hw = hardware.Measurement(
        name=f"measured {device}",
        memory_bytes=0,
        bandwidth_bytes_per_s=probe.bandwidth_bytes_per_s,
        flops=matmul.flops,
        flops_dtype=str(model.dtype).removeprefix("torch."),
        host_link_bytes_per_s=None,
        copy_bytes=probe.nbytes,
        matmul_size=matmul.n,
    )
    work = {p: prefill(model.config, hw, 1, p, model.dtype).time_s for p in prompt_lens}
    hollow_work = prefill(hollow.config, hw, 1, prompt_lens[0], hollow.dtype).time_s
    overhead = StepTiming(1, prompt_lens[0], tuple(fixed))
    steps_timing = StepTiming(1, prompt_lens[0], tuple(steps))
    return PrefillSweep(prefills, steps_timing, overhead, work, device.type == "cpu", hollow_work)


def check_prefill(
    sweep: PrefillSweep,
    *,
    min_growth: float = 8,
    long_end: float = 0.75,
    max_at_once: float = 0.5,
    dominance: float = PREFILL_DOMINANCE,
) -> list[Check]:
    """The prefill claims of *Prefill and decode*: the shortest not the cheapest per token (a fixed floor); the
    longest prefill under `max_at_once` × as many single-token decode steps; and, where the long end is work
    (`PrefillSweep.work_bound`: the second-longest prompt's predicted work at least `dominance` × the fixed
    cost), the longest prompt at least `min_growth` × the shortest's TTFT and the two longest prompts' TTFT
    growing at least `long_end` × as fast as their lengths (the compute-bound end). Where launches set every
    prefill's time (a small model on a GPU) those two are not held; on a CPU the sizes must make the long end
    work, or CI would never check them."""
    lens = sweep.prompt_lens
    length_ratio = lens[-1] / lens[-2]
    work = sweep.work_bound(dominance)
    checks = []
    if sweep.on_cpu and sweep.overhead is not None:
        detail = f"{sweep.dominance():.1f}x the fixed cost at {lens[-2]} tokens, needs {dominance:g}x"
        checks.append(Check("the CPU sizes make the long end work", work, detail))
    if work:
        checks += [
            Check(
                "TTFT grows with the prompt",
                sweep.growth > min_growth,
                f"{sweep.growth:.1f}x > {min_growth:g}x",
            ),
            Check(
                "the long end is compute-bound",
                sweep.last_growth > long_end * length_ratio,
                f"{sweep.last_growth:.2f}x for {length_ratio:g}x the tokens, "
                f"needs > {long_end * length_ratio:.2f}x",
            ),
        ]
    checks += [
        Check(
            "a short prompt pays a fixed floor",
            sweep.cheapest != lens[0],
            f"cheapest per token: {sweep.cheapest}",
        ),
        less("prefill over one token at a time", sweep.at_once, max_at_once),
    ]
    return checks
