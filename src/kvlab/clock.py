"""The engine's clock: real wall time, or a virtual clock that replays a trace deterministically and fast.

The virtual clock charges each step a modelled duration instead of measuring it, so the same seed gives the same
timeline on any machine, and waiting for the next arrival costs nothing. Its default cost model is a toy with
the right shape for a decoder on a GPU: a fixed per-step cost (weights read once per step), plus a cost per
scheduled token (compute) and per context token read (KV cache traffic); set the constants for another regime.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def step_done(self, num_batched_tokens: int, num_context_tokens: int) -> None: ...

    def wait_until(self, t: float) -> None: ...


class WallClock:
    """Seconds since the engine started, from `time.perf_counter`."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def step_done(self, num_batched_tokens: int, num_context_tokens: int) -> None:
        pass  # the step's real duration has already passed

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


@dataclass
class VirtualClock:
    """Time advances only by the modelled cost of each step, and jumps to the next arrival when idle."""

    step_overhead_s: float = 10e-3
    per_token_s: float = 50e-6
    per_context_token_s: float = 1e-6
    t: float = 0.0

    def now(self) -> float:
        return self.t

    def step_seconds(self, num_batched_tokens: int, num_context_tokens: int) -> float:
        return (
            self.step_overhead_s
            + self.per_token_s * num_batched_tokens
            + self.per_context_token_s * num_context_tokens
        )

    def step_done(self, num_batched_tokens: int, num_context_tokens: int) -> None:
        self.t += self.step_seconds(num_batched_tokens, num_context_tokens)

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)
