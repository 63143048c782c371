"""The cost of a decode step that streams offloaded layers, and the claim that it holds.

No overlap: the loop transfers and computes one after the other, so the step is the compute-only step plus the
offloaded bytes over each hop's bandwidth (`offload_cost`). `fit_offload` sets that against one
`kvlab.offload.loop.time_offload` measurement, with a band that is a test of equal medians from
distribution-free intervals (`median_interval`), so that it holds at its designed rate on any device;
`measure_offload` and `check_offload` are one measurement and its `kvlab.claims` checks.
Chapter *Beyond HBM* (book/12_beyond_hbm).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache

from kvlab import claims
from kvlab.checks import check_count
from kvlab.offload.cache import TIERS, DiskLayer, OffloadedCache
from kvlab.offload.loop import OffloadTiming, random_prompt, time_offload
from kvlab.specs.sizing import DType, kv_cache_bytes

_HOPS = {"disk": "disk read", "ram": "reorder (RAM copy)", "h2d": "host → device"}


@dataclass(frozen=True)
class OffloadCost:
    """Predicted seconds a decode step adds by streaming offloaded layers: one term per hop."""

    # K/V bytes of the offloaded layers at this context
    bytes_per_step: int
    # of which read from disk (whole blocks)
    disk_bytes_per_step: int
    # hop -> seconds
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())


def offload_cost(
    config: PretrainedConfig,
    context: int,
    offloaded_layers: int,
    tier: str,
    bandwidths: dict[str, float],
    batch_size: int = 1,
    dtype: DType = "fp32",
    block_tokens: int | None = None,
    disk_latency_s: float = 0.0,
    link_latency_s: float = 0.0,
) -> OffloadCost:
    """Seconds per decode step that streaming `offloaded_layers` layers' K/V at `context` tokens adds.

    `bandwidths` maps each hop the bytes take to its measured bytes/s. `tier="disk"` needs `"disk"` (an O_DIRECT
    read; only whole blocks of `block_tokens` come from disk, the partial block is in RAM already), and on CPU
    `"ram"` (the one copy that reorders token-major records into (batch, heads, tokens, dim): a RAM copy's
    payload rate), on a GPU `"h2d"` (the upload from pageable memory; the reorder then runs on the GPU).
    `tier="host"` needs `"h2d"` (from pinned memory). Every hop given is charged; all full-attention layers are
    assumed the same size, as in the registry's models and the tiny ones. `disk_latency_s` is charged once per
    offloaded layer that has a block on disk (one read request each). `link_latency_s`, the latency of one small
    host-link copy, is charged twice per offloaded layer on the host tier (the new token's K and V copied out, the
    layer's K and V copied in, each one synchronous copy).
    """
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    check_count("context", context, 1)
    check_count("offloaded_layers", offloaded_layers, 0)
    text = config.get_text_config(decoder=True)
    if offloaded_layers > text.num_hidden_layers:
        raise ValueError(f"offloaded_layers={offloaded_layers} exceeds the {text.num_hidden_layers} layers")
    for name, value in bandwidths.items():
        if name not in _HOPS:
            raise ValueError(f"unknown hop {name!r}; known: {', '.join(_HOPS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"bandwidth {name!r} must be a positive number of bytes/s, got {value!r}")
    required = "disk" if tier == "disk" else "h2d"
    if required not in bandwidths:
        raise ValueError(
            f"tier {tier!r} needs a {required!r} bandwidth; got {', '.join(bandwidths) or 'none'}"
        )
    if block_tokens is not None:
        check_count("block_tokens", block_tokens, 1)
    for name, value in (("disk_latency_s", disk_latency_s), ("link_latency_s", link_latency_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    per_layer = kv_cache_bytes(config, context, batch_size, dtype) // text.num_hidden_layers
    total = per_layer * offloaded_layers
    disk_tokens = context if block_tokens is None else context // block_tokens * block_tokens
    disk_bytes = total // context * disk_tokens if tier == "disk" else 0
    terms: dict[str, float] = {}
    for hop, rate in bandwidths.items():
        if hop == "disk" and tier == "disk":
            requests = offloaded_layers if disk_bytes else 0
            terms[_HOPS[hop]] = requests * disk_latency_s + disk_bytes / rate
        elif hop != "disk":
            terms[_HOPS[hop]] = total / rate
    if tier == "host" and link_latency_s:
        terms["copy latency"] = 2 * offloaded_layers * link_latency_s
    return OffloadCost(total, disk_bytes, terms)


def median_interval(values: Sequence[float], confidence: float = 0.99) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of the population `values` were drawn from.

    The k-th smallest and the k-th largest of n values bracket the median with probability
    1 - 2 P(Binomial(n, 1/2) <= k - 1), whatever the distribution (the sign test); k is the largest for which
    that is at least `confidence`. Needs enough values for any k to qualify (8 at 0.99)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    n = len(values)
    tail, k = 0.0, 0
    while k < n // 2:
        tail += math.comb(n, k) / 2**n
        if 2 * tail > 1 - confidence:
            break
        k += 1
    if k == 0:
        raise ValueError(f"{n} values are too few for a {confidence:.0%} interval of their median")
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


# How closely the cost model is claimed: a tenth of the transfer term. What the claim rules out lies ten times as
# far: a loop whose transfer overlaps the compute or is not paid for (0x the term), or is paid twice (2x). The
# repeated accesses that give the term ran 1-3 % of the step from the step's own on the CPU that built this book.
TRANSFER_TOLERANCE = 0.1


@dataclass(frozen=True)
class OffloadFit:
    """Predicted against measured median offloaded step at one context, with the band the measurements' spread
    allows. No overlap: the loop transfers and computes one after the other, so predicted = compute + transfer."""

    context: int
    # median in-memory step less its appends to the offloaded layers: the compute-only step
    compute_s: float
    # the transfer term, from the bandwidth of the loop's own transfers repeated between steps
    cost: OffloadCost
    # median offloaded step
    measured_s: float
    low_s: float
    high_s: float
    # median in-memory step, appends included
    memory_s: float = 0.0
    confidence: float = 0.99
    overlap: bool = False

    @property
    def transfer_s(self) -> float:
        return self.cost.seconds

    @property
    def predicted_s(self) -> float:
        """compute + transfer with no overlap; max(compute, transfer) if the loop overlapped them perfectly."""
        if self.overlap:
            return max(self.compute_s, self.transfer_s)
        return self.compute_s + self.transfer_s

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s

    @property
    def band(self) -> tuple[float, float]:
        """The band's edges relative to the prediction: (low / predicted - 1, high / predicted - 1)."""
        return self.low_s / self.predicted_s - 1, self.high_s / self.predicted_s - 1

    @property
    def transfer_share(self) -> float:
        """The transfer term's share of the predicted step."""
        return self.transfer_s / self.predicted_s

    @property
    def holds(self) -> bool:
        return self.low_s <= self.measured_s <= self.high_s


def fit_offload(
    timing: OffloadTiming,
    config: PretrainedConfig,
    offloaded_layers: int,
    tier: str,
    batch_size: int = 1,
    dtype: DType = "fp32",
    block_tokens: int | None = None,
    confidence: float = 0.99,
    tolerance: float = TRANSFER_TOLERANCE,
) -> OffloadFit:
    """The cost model against one `time_offload` measurement.

    compute: the median in-memory step less the in-memory layers' appends to the histories of the layers that
    are offloaded (an offloaded layer does not concatenate; it reorders what the tier delivered, which the
    transfer term times). transfer: `offload_cost` at the loop's middle context over the median bandwidth of the
    repeated tier work (the loop's request sizes, so per-request latency is in that figure). No overlap is
    modelled, because the loop has none.

    The band is a test of equal medians, with no allowance a machine or device would have to justify: the
    measured median's distribution-free `confidence` interval (`median_interval`) and the prediction's (from the
    per-step predictions, each step's compute plus the transfer repeated right after it, same load) must
    overlap. Placed around the prediction: the measured median must lie within the prediction's interval widened
    by the measured median's, below by (its upper edge - median), above by (median - its lower edge). Where the
    model is right, the two intervals miss each other less often than either misses its own median.

    The model itself is claimed to `tolerance` of the transfer term (`TRANSFER_TOLERANCE`), which widens the
    band by that much on each side: the repeated accesses are timed apart from the step, with the CPU's caches
    and the drive in a state close to, not the same as, the step's.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction of the transfer term in [0, 1), got {tolerance!r}")
    steps = len(timing.offloaded.step_s)
    if steps < 8:
        raise ValueError(f"fit_offload needs at least 8 decode steps, got {steps}")
    # the history grows by one token per step: the middle step's
    context = timing.context + steps // 2 + 1
    hop = "disk" if tier == "disk" else "h2d"
    cost = offload_cost(
        config, context, offloaded_layers, tier, {hop: timing.bandwidth.median_bytes_per_s},
        batch_size=batch_size, dtype=dtype, block_tokens=block_tokens,
    )  # fmt: skip
    compute = median(timing.compute_s)
    predicted = compute + cost.seconds
    per_step = [c + t for c, t in zip(timing.compute_s, timing.transfer_s, strict=True)]
    p_low, p_high = median_interval(per_step, confidence)
    centre = median(per_step)
    measured = timing.offloaded.median_step_s
    m_low, m_high = median_interval(timing.offloaded.step_s, confidence)
    allowance = tolerance * cost.seconds
    low = predicted - allowance - (centre - p_low) - (m_high - measured)
    high = predicted + allowance + (p_high - centre) + (measured - m_low)
    return OffloadFit(
        timing.context, compute, cost, measured, low, high, timing.memory.median_step_s, confidence
    )


@dataclass(frozen=True)
class OffloadSweep:
    """One measurement of the offloaded decode loop at each context: the timings and the fits."""

    tier: str
    offloaded: tuple[int, ...]
    timings: dict[int, OffloadTiming]
    fits: dict[int, OffloadFit]

    @property
    def tokens(self) -> int:
        """Greedy tokens per loop, all contexts and sequences: every loop produced these same tokens."""
        return sum(len(seq) for t in self.timings.values() for seq in t.memory.tokens)


def measure_offload(
    model: Any,
    contexts: Sequence[int],
    offloaded: Sequence[int],
    tier: str,
    new_tokens: int,
    batch: int = 1,
    seed: int = 0,
    transformers_offloading: bool = False,
    make_cache: Callable[..., OffloadedCache] = OffloadedCache,
) -> OffloadSweep:
    """`time_offload` and `fit_offload` at every context, on `random_prompt`s: one measurement of the claim.

    With `transformers_offloading`, transformers' `DynamicCache(offloading=True)` decodes in lockstep too (GPU
    only). `make_cache(config, layers, tier=...)` builds the offloaded cache (a test can hand in a wrong one).
    The loops must produce the same greedy tokens: moving bytes changes no value, so a difference is a bug,
    not noise, and raises."""
    config = model.config
    vocab = config.get_text_config(decoder=True).vocab_size
    timings, fits = {}, {}
    for context in contexts:
        with make_cache(config, list(offloaded), tier=tier) as cache:
            others = [DynamicCache(config=config, offloading=True)] if transformers_offloading else []
            ids = random_prompt(vocab, batch, context, seed)
            timing = time_offload(model, ids, new_tokens, cache, others)
            layer = cache.layers[offloaded[0]]
            block_tokens = layer.block_tokens if isinstance(layer, DiskLayer) else None
        runs = [timing.offloaded, *timing.others]
        if any(run.tokens != timing.memory.tokens for run in runs):
            raise AssertionError(f"context {context}: a loop's tokens differ from the in-memory loop's")
        timings[context] = timing
        fits[context] = fit_offload(timing, config, len(offloaded), tier, batch, model.dtype, block_tokens)
    return OffloadSweep(tier, tuple(offloaded), timings, fits)


def check_offload(sweep: OffloadSweep, min_share: float = 0.2) -> list[claims.Check]:
    """The claim on one `measure_offload`: at the longest context the transfer is at least `min_share` of the
    step and the offloaded step is longer than the compute-only one; at every context where the transfer is that
    large, the measured median step is in the band around compute + transfer (`fit_offload`), and the band's lower
    edge is above the compute-only step, so that it tells a loop that pays for its transfers from one that does
    not (whose median step would be the compute-only step)."""
    fits = [sweep.fits[c] for c in sorted(sweep.fits)]
    last = fits[-1]
    checks = [
        claims.Check(
            f"{last.context} tokens: transfer at least {min_share:.0%} of the predicted step",
            last.transfer_share >= min_share,
            f"{last.transfer_share:.0%}",
        ),
        claims.less(
            f"{last.context} tokens: compute-only step shorter than the offloaded step (ms)",
            last.compute_s * 1e3,
            last.measured_s * 1e3,
        ),
    ]
    for f in fits:
        if f.transfer_share >= min_share:
            checks.append(
                claims.between(
                    f"{f.context} tokens: offloaded step (ms) in the band around compute + transfer",
                    f.measured_s * 1e3,
                    f.low_s * 1e3,
                    f.high_s * 1e3,
                )
            )
            checks.append(
                claims.less(
                    f"{f.context} tokens: band above the compute-only step (ms)",
                    f.compute_s * 1e3,
                    f.low_s * 1e3,
                )
            )
    return checks
