"""The engine's clock: real wall time, the process's CPU time, or a virtual clock that replays a trace
deterministically and fast.

`WallClock` reads `time.perf_counter` and sleeps until the next arrival. `WallClock(cpu=True)` reads the process's
CPU time (`time.process_time`) and jumps over a wait, so the engine's own work is measured and the time slices
other processes take are not (what `kvlab.planning.simulate.record_engine_steps` calibrates on). `VirtualClock`
charges each step a modelled duration, so the same seed gives the same timeline on any machine. Its default cost
is a toy with a decoder's shape: a fixed cost per step, plus one per scheduled token and one per context token
read. A runner that models the step itself (`kvlab.engine.cost_runner.CostRunner`) gives the seconds instead.
Chapters 8 and 14.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def step_done(self, num_batched_tokens: int, num_context_tokens: int, seconds: float | None) -> None: ...

    def wait_until(self, t: float) -> None: ...


class WallClock:
    """Seconds since the engine started: wall time (`time.perf_counter`), or with `cpu=True` the process's CPU
    time (`time.process_time`), where a wait for the next arrival jumps the clock forward instead of sleeping."""

    def __init__(self, cpu: bool = False) -> None:
        self._read = time.process_time if cpu else time.perf_counter
        self._cpu = cpu
        self._offset = -self._read()

    def now(self) -> float:
        return self._read() + self._offset

    def step_done(self, num_batched_tokens: int, num_context_tokens: int, seconds: float | None) -> None:
        # The step's real duration has already passed.
        pass

    def wait_until(self, t: float) -> None:
        if self._cpu:
            self._offset += max(0.0, t - self.now())
        else:
            time.sleep(max(0.0, t - self.now()))


@dataclass
class VirtualClock:
    """Time advances only by the modelled cost of each step, and jumps to the next arrival when idle.

    A step's cost is the runner's `seconds` where the runner models it (a cost runner), else `step_seconds`."""

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

    def step_done(self, num_batched_tokens: int, num_context_tokens: int, seconds: float | None) -> None:
        self.t += self.step_seconds(num_batched_tokens, num_context_tokens) if seconds is None else seconds

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)
