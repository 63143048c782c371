"""The one argument check kvlab's functions share: a count is an integer (never a bool) of at least a minimum."""

from __future__ import annotations

from typing import Any


def check_count(name: str, value: Any, minimum: int = 1, error: type[ValueError] = ValueError) -> int:
    """`value` itself when it is an int >= `minimum`; else `error` naming `name` (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
