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
from typing import TYPE_CHECKING, Any

from kvlab.costs.workloads import TraceRequest

if TYPE_CHECKING:
    from kvlab.planning.simulate import SimulationResult


@dataclass(frozen=True)
class Frontend:
    """A fixed delay, in seconds, between a request's arrival and the engine seeing it."""

    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.request_overhead_s) or self.request_overhead_s < 0:
            raise ValueError(
                f"request_overhead_s must be a finite number >= 0, got {self.request_overhead_s!r}"
            )

    def arrivals(self, trace: Sequence[TraceRequest]) -> list[TraceRequest]:
        """`trace` as the engine sees it: every arrival later by the delay (the same requests with none)."""
        delay = self.request_overhead_s
        return (
            [dataclasses.replace(r, arrival_time=r.arrival_time + delay) for r in trace]
            if delay
            else list(trace)
        )

    def served(self, result: SimulationResult) -> SimulationResult:
        """`result` of a run on `arrivals(...)`, each request's metrics timed again from its real arrival."""
        if self.request_overhead_s:
            for metrics in result.requests:
                metrics.arrival_time -= self.request_overhead_s
        return result

    def simulate(
        self,
        trace: Sequence[TraceRequest],
        cost: Callable[[Sequence[int], Sequence[int]], float],
        **knobs: Any,
    ) -> SimulationResult:
        """`kvlab.planning.simulate.simulate(trace, cost, **knobs)` with every arrival delayed by the overhead,
        and each request's metrics timed from its real arrival. Under `concurrency` (a closed loop) the delay
        is added to each request's latencies but does not hold the engine idle between requests. With no
        delay it is `simulate` itself, result for result."""
        from kvlab.planning.simulate import simulate

        knobs.setdefault("record_steps", False)
        return self.served(simulate(self.arrivals(trace), cost, **knobs))
