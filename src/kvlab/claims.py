"""A measured claim as a statistical test: checks on one measurement, re-measured a bounded number of times.

A timing assert on a shared machine misses now and then even when the claim is true. The protocol here keeps
that rate designed and visible: each attempt measures afresh and runs every check; the claim holds as soon as
one attempt passes them all, and fails after `attempts` misses. Every attempt is printed, and the verdict
carries the count so a lab can glue it. If one attempt misses a true claim with probability p, independently,
the claim fails with probability p**attempts; a wrong claim (a cost doubled, a cache that never hits) misses
every attempt, so the protocol still catches it. `benchmarks/flakiness.py` measures the real rates.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# The line measure_claim prints for each attempt; benchmarks/flakiness.py reads it back from a lab's output.
_ATTEMPT = re.compile(r"^(?P<claim>.+), attempt (?P<number>\d+)/(?P<of>\d+): (?P<state>holds|misses)", re.M)


@dataclass(frozen=True)
class Check:
    """One condition of a claim on one measurement, with the numbers that decided it."""

    name: str
    holds: bool
    detail: str = ""

    def __str__(self) -> str:
        mark = "holds" if self.holds else "MISSES"
        return f"{self.name}: {mark}" + (f" ({self.detail})" if self.detail else "")


def within(name: str, measured: float, predicted: float, tolerance: float) -> Check:
    """|measured / predicted - 1| <= tolerance."""
    if not tolerance > 0:
        raise ValueError(f"tolerance must be positive, got {tolerance!r}")
    if not predicted > 0 or not math.isfinite(predicted):
        raise ValueError(f"{name}: the prediction must be a positive number, got {predicted!r}")
    error = measured / predicted - 1
    return Check(name, abs(error) <= tolerance, f"{error:+.0%} against ±{tolerance:.0%}")


def between(name: str, value: float, low: float, high: float) -> Check:
    """low <= value <= high."""
    if not low <= high:
        raise ValueError(f"{name}: the band [{low!r}, {high!r}] is empty")
    return Check(name, low <= value <= high, f"{value:.4g} in [{low:.4g}, {high:.4g}]")


def less(name: str, smaller: float, larger: float) -> Check:
    """smaller < larger."""
    return Check(name, smaller < larger, f"{smaller:.4g} < {larger:.4g}")


@dataclass(frozen=True)
class Attempt(Generic[T]):
    number: int
    result: T
    checks: tuple[Check, ...]

    @property
    def holds(self) -> bool:
        return all(c.holds for c in self.checks)

    @property
    def misses(self) -> list[Check]:
        return [c for c in self.checks if not c.holds]


@dataclass(frozen=True)
class Verdict(Generic[T]):
    """Every attempt at one claim; `result` is the measurement that decided it."""

    claim: str
    attempts: tuple[Attempt[T], ...]
    max_attempts: int

    @property
    def holds(self) -> bool:
        return self.attempts[-1].holds

    @property
    def result(self) -> T:
        return self.attempts[-1].result

    @property
    def count(self) -> int:
        return len(self.attempts)

    def summary(self) -> str:
        if self.holds:
            return f"{self.claim}: held at attempt {self.count} of at most {self.max_attempts}"
        return f"{self.claim}: missed all {self.count} attempts"

    def require(self) -> T:
        """The deciding result, or an AssertionError naming every check the last attempt missed."""
        if not self.holds:
            missed = "; ".join(map(str, self.attempts[-1].misses))
            raise AssertionError(f"{self.summary()}; last attempt: {missed}")
        return self.result


def measure_claim(
    claim: str,
    measure: Callable[[], T],
    check: Callable[[T], Iterable[Check]],
    attempts: int = 3,
    log: Callable[[str], object] | None = print,
) -> Verdict[T]:
    """Measure and check up to `attempts` times; stop at the first attempt where every check holds."""
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a whole number of at least 1, got {attempts!r}")
    done: list[Attempt[T]] = []
    for number in range(1, attempts + 1):
        result = measure()
        checks = tuple(check(result))
        if not checks:
            raise ValueError(f"{claim}: the check returned no conditions, so it could not fail")
        done.append(Attempt(number, result, checks))
        if log is not None:
            state = "holds" if done[-1].holds else "misses: " + "; ".join(map(str, done[-1].misses))
            log(f"{claim}, attempt {number}/{attempts}: {state}")
        if done[-1].holds:
            break
    return Verdict(claim, tuple(done), attempts)


@dataclass(frozen=True)
class AttemptLine:
    """One attempt as a lab printed it."""

    claim: str
    number: int
    of: int
    holds: bool


def parse_attempts(text: str) -> list[AttemptLine]:
    """The attempts `measure_claim` printed in `text` (a lab's output), in order."""
    return [
        AttemptLine(m["claim"], int(m["number"]), int(m["of"]), m["state"] == "holds")
        for m in _ATTEMPT.finditer(text)
    ]
