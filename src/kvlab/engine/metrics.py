"""Serving metrics of finished requests, under the names vLLM's serving benchmark prints.

A request's timeline: it arrives, waits, its first token appears (TTFT = first token - arrival), then one token
at a time (ITL = the gaps between consecutive tokens), until it finishes (E2EL = finish - arrival). TPOT is the
mean time per output token after the first: (E2EL - TTFT) / (output tokens - 1). Goodput counts only requests
that meet every latency target. Times are seconds in; the summary reports milliseconds, like
`vllm bench serve` (keys such as `mean_ttft_ms`, `p99_itl_ms`, `request_throughput`, `output_throughput`).
The functions take any objects with `RequestMetrics`' fields: a measured engine, a simulator or a roofline model.
The engine's per-step statistics (`StepStats`: KV utilisation, batch occupancy, fragmentation) and its prefix-cache
counters (`PrefixCacheStats`, vLLM's name) live here too, next to the predictions they are checked against.
Chapters 5-9 and 14.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from kvlab.measure import percentiles
from kvlab.units import cdiv


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (seconds, one clock) and counts of one request."""

    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token appeared
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    def _since_arrival(self, time: float | None, event: str) -> float:
        if time is None:
            raise ValueError(f"request has no {event} yet: its latency is not defined until it happens")
        return time - self.arrival_time

    @property
    def ttft(self) -> float:
        return self._since_arrival(self.first_token_time, "first token")

    @property
    def e2e_latency(self) -> float:
        return self._since_arrival(self.finish_time, "finish")

    @property
    def queue_time(self) -> float:
        return self._since_arrival(self.first_scheduled_time, "first scheduling")

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gap before each output token after the first."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs (vLLM leaves them out)."""
        n = self.num_output_tokens
        return (self.e2e_latency - self.ttft) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class SLO:
    """Latency targets in milliseconds for goodput; None means no target on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, m: RequestMetrics) -> bool:
        checks = [(self.ttft_ms, m.ttft), (self.tpot_ms, m.tpot or 0.0), (self.e2el_ms, m.e2e_latency)]
        return all(target is None or value * 1e3 <= target for target, value in checks)


def duration(requests: Sequence[RequestMetrics]) -> float:
    """Seconds from the first arrival to the last finish: the benchmark's wall time."""
    return max(r.arrival_time + r.e2e_latency for r in requests) - min(r.arrival_time for r in requests)


def _stats(name: str, seconds: Sequence[float] | np.ndarray, qs: Sequence[float]) -> dict[str, float]:
    if not len(seconds):
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"std_{name}_ms": 0.0} | {
            f"p{q:g}_{name}_ms": 0.0 for q in qs
        }
    ms = np.asarray(seconds, dtype=float) * 1e3
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms))}
    out[f"std_{name}_ms"] = float(ms.std())
    out |= {f"{key}_{name}_ms": value for key, value in percentiles(ms, qs).items()}
    return out


def inter_token_latencies(requests: Sequence[RequestMetrics]) -> np.ndarray:
    """Every request's `itls`, in request order, as one array: the gaps of all token times laid end to end,
    less the gaps that join one request to the next (a long trace holds millions of tokens)."""
    lengths = np.fromiter((len(r.token_times) for r in requests), dtype=np.int64, count=len(requests))
    total = int(lengths.sum())
    if total < 2:
        return np.empty(0)
    times = np.fromiter(chain.from_iterable(r.token_times for r in requests), dtype=float, count=total)
    keep = np.ones(total - 1, dtype=bool)
    # The gap after each request's last token crosses into the next request.
    last = np.cumsum(lengths) - 1
    keep[last[(last >= 0) & (last < total - 1)]] = False
    return np.diff(times)[keep]


def summarize(
    requests: Sequence[RequestMetrics],
    elapsed: float | None = None,
    slo: SLO | None = None,
    qs: Sequence[float] = (50, 95, 99),
) -> dict[str, float]:
    """vLLM-style benchmark summary of finished requests; `elapsed` defaults to `duration(requests)`."""
    if not requests:
        raise ValueError("summarize needs at least one finished request")
    elapsed = duration(requests) if elapsed is None else elapsed
    inputs = sum(r.num_prompt_tokens for r in requests)
    outputs = sum(r.num_output_tokens for r in requests)
    out: dict[str, float] = {
        "completed": len(requests),
        "duration": elapsed,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(requests) / elapsed,
        "output_throughput": outputs / elapsed,
        "total_token_throughput": (inputs + outputs) / elapsed,
    }
    if slo is not None:
        out["request_goodput"] = sum(slo.met_by(r) for r in requests) / elapsed
    out |= _stats("ttft", [r.ttft for r in requests], qs)
    out |= _stats("tpot", [r.tpot for r in requests if r.tpot is not None], qs)
    out |= _stats("itl", inter_token_latencies(requests), qs)
    out |= _stats("e2el", [r.e2e_latency for r in requests], qs)
    return out


# --- engine step statistics, and what the allocator predicts for them ------------------------------------------------


@dataclass(frozen=True)
class Fragmentation:
    """Per sequence, averaged over (sequence, step) pairs: the two costs a block size trades."""

    last_block_waste: float  # empty token slots in the sequence's last block
    table_entries: float  # blocks in its block table


def predicted_fragmentation(context_lengths: Iterable[int], block_size: int) -> Fragmentation:
    """Paged allocation's cost for sequences holding these numbers of tokens: `ceil(n / B)` blocks each, and
    `ceil(n / B) * B - n` empty slots, all in the last block. For lengths spread evenly over a block the waste
    averages `(B - 1) / 2` tokens whatever the lengths; the table grows as `n / B`."""
    lengths = list(context_lengths)
    if not lengths:
        raise ValueError("need at least one context length")
    entries = [cdiv(n, block_size) for n in lengths]
    waste = sum(b * block_size - n for b, n in zip(entries, lengths, strict=True))
    return Fragmentation(waste / len(lengths), sum(entries) / len(lengths))


@dataclass(frozen=True)
class StepStats:
    """The engine's state after one step: the batch it ran and the KV blocks it holds."""

    step: int
    time: float  # clock time at the end of the step
    num_running: int
    num_waiting: int  # arrived or not
    num_batched_tokens: int
    num_prefill_tokens: int  # tokens of sequences computing more than one token this step
    num_decode_seqs: int
    num_preempted: int
    blocks_used: int
    used_token_slots: int  # pool slots holding a computed token
    reserved_token_slots: int  # slots of the blocks in use

    @property
    def kv_utilisation(self) -> float:
        """Bytes holding real token states / bytes reserved."""
        return self.used_token_slots / self.reserved_token_slots if self.reserved_token_slots else 1.0


def mean_kv_utilisation(stats: Sequence[StepStats]) -> float:
    """Utilisation over a run: slots holding tokens / slots reserved, summed over steps."""
    reserved = sum(s.reserved_token_slots for s in stats)
    return sum(s.used_token_slots for s in stats) / reserved if reserved else 1.0


def measured_fragmentation(stats: Sequence[StepStats]) -> Fragmentation:
    """Per running sequence and step: empty slots of blocks in use, and blocks in use (no prefix sharing)."""
    seq_steps = sum(s.num_running for s in stats)
    if not seq_steps:
        raise ValueError("no step ran a sequence")
    waste = sum(s.reserved_token_slots - s.used_token_slots for s in stats)
    return Fragmentation(waste / seq_steps, sum(s.blocks_used for s in stats) / seq_steps)


def mean_batch_occupancy(stats: Sequence[StepStats]) -> float:
    """Sequences in the running batch after each step, averaged over steps."""
    return sum(s.num_running for s in stats) / len(stats) if stats else 0.0


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the engine started, each request counted once (vLLM's `PrefixCacheStats`)."""

    requests: int = 0  # requests looked up at their first admission
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from cached blocks
    hit_requests: int = 0  # requests that found at least one cached block

    def record(self, num_tokens: int, num_hits: int) -> PrefixCacheStats:
        """These counts plus one request's lookup of `num_tokens` prompt tokens, `num_hits` of them cached."""
        return PrefixCacheStats(
            self.requests + 1,
            self.queries + num_tokens,
            self.hits + num_hits,
            self.hit_requests + (num_hits > 0),
        )

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from cached blocks."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def request_hit_rate(self) -> float:
        """Share of requests that found at least one cached block."""
        return self.hit_requests / self.requests if self.requests else 0.0
