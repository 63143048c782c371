"""The serving front end's delay: time a request spends before the engine's scheduler first sees it.

A served request is received over HTTP, tokenized and handed to the engine core before any step can schedule it,
and its first token is detokenized and sent back after; vLLM's server-side TTFT counts all of it (its request
span starts on arrival at the API server). The step cost has no such term: `Frontend.request_overhead_s` is
one fixed delay per request, added to its TTFT and end-to-end latency (open loop: the engine sees the request
that much later). Its value is not cited: `kvlab.planning.measured.fit` measures it on published runs.
Chapter: *Capacity planning* (book/14_capacity_planning).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.costs.workloads import TraceRequest
from kvlab.engine.metrics import RequestMetrics


@dataclass(frozen=True)
class Frontend:
    """A fixed delay, in seconds, between a request's arrival and the engine seeing it."""

    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.request_overhead_s) or self.request_overhead_s < 0:
            raise ValueError(
                f"request_overhead_s must be a finite number >= 0, got {self.request_overhead_s!r}"
            )

    def simulate(
        self,
        trace: Sequence[TraceRequest],
        cost: Callable[[Sequence[int], Sequence[int]], float],
        **knobs: Any,
    ) -> list[RequestMetrics]:
        """`kvlab.planning.simulate.simulate(trace, cost, **knobs)` with every arrival delayed by the overhead,
        and each request's metrics timed from its real arrival. Under `concurrency` (a closed loop) the delay
        is added to each request's latencies but does not hold the engine idle between requests."""
        from kvlab.planning.simulate import simulate

        delay = self.request_overhead_s
        delayed = [dataclasses.replace(r, arrival_time=r.arrival_time + delay) for r in trace]
        result = simulate(delayed if delay else list(trace), cost, record_steps=False, **knobs)
        for metrics in result.requests:
            metrics.arrival_time -= delay
        return result.requests
