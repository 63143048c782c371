"""Reading and writing sizes the way people type them: 32k tokens, 1.5 GiB, 500ms, 4/s."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KiB, MiB, GiB = 2**10, 2**20, 2**30
_TOKEN_SCALE = {"k": 1024, "m": 1024 * 1024}


def parse_tokens(text: str | int) -> int:
    """'32k' -> 32768, '1m' -> 1048576, '4096' -> 4096. Zero, negatives and malformed text are errors."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip().lower()
        scale = _TOKEN_SCALE.get(raw[-1:], 1)
        digits = raw[:-1] if scale != 1 else raw
        if not digits.isdigit():
            raise ValueError(f"cannot read {text!r} as a token count; use e.g. 4096, 32k or 1m")
        value = int(digits) * scale
    if value <= 0:
        raise ValueError(f"a token count must be positive, got {text!r}")
    return value


def parse_millis(text: str) -> float:
    """'500ms', '0.5s', '20us' or a bare number, in milliseconds. Zero, infinite and malformed text are errors."""
    raw = text.strip().lower()
    scale = 1.0
    if raw.endswith("ms"):
        raw = raw[:-2]
    elif raw.endswith(("us", "µs")):
        raw, scale = raw[:-2], 1e-3
    elif raw.endswith("s"):
        raw, scale = raw[:-1], 1e3
    try:
        value = float(raw) * scale
    except ValueError:
        raise ValueError(f"expected a duration such as 500ms or 0.5s, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"expected a positive duration, got {text!r}")
    return value


def parse_rate(text: str) -> float:
    """'4/s', '4' (requests per second) or '240/min', in requests per second."""
    raw = text.strip().lower()
    scale = 1.0
    if raw.endswith("/min"):
        raw, scale = raw[:-4], 1 / 60
    elif raw.endswith("/s"):
        raw = raw[:-2]
    try:
        value = float(raw) * scale
    except ValueError:
        raise ValueError(f"expected a request rate such as 4/s, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"expected a positive request rate, got {text!r}")
    return value


def cdiv(a: int, b: int) -> int:
    """`a / b` rounded up, for integers (vLLM's `cdiv`): the blocks that `a` tokens fill at `b` a block."""
    return -(-a // b)


def format_bytes(n: float, digits: int = 3) -> str:
    """Binary units: 1536 -> '1.5 KiB'. Keeps `digits` significant digits."""
    if n < 0:
        return "-" + format_bytes(-n, digits)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if unit == "B" and n < 1024:
            return f"{int(n)} B"
        if n < 1024 or unit == "TiB":
            text = f"{n:.{digits}g}"
            # 1000-1023 of a unit: `g` would switch to '1.01e+03'; whole units read better
            if "e" in text:
                text = f"{n:.0f}"
            # 1023.6 KiB rounds to 1024 KiB, which is 1 MiB
            if text != "1024" or unit == "TiB":
                return f"{text} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_tokens(n: int) -> str:
    """4096 -> '4k', 131072 -> '128k', 1000 -> '1000'."""
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def join_words(items: Sequence[str], lang: str = "en") -> str:
    """A list as a chapter's prose says it: "a, b and c" in English, "a、b 和 c" in Chinese (the zh edition)."""
    words = [str(item) for item in items]
    if lang not in ("en", "zh"):
        raise ValueError(f"unknown language {lang!r}: 'en' or 'zh'")
    if len(words) < 2:
        return "".join(words)
    head, last = words[:-1], words[-1]
    return ", ".join(head) + " and " + last if lang == "en" else "、".join(head) + " 和 " + last


def format_count(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless `n` is 1: "1 thread", "2 threads"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_floor(x: float, decimals: int = 0) -> str:
    """A lower bound for prose: `decimals` places, rounded down, so "at least" never overstates it (14.7 -> '14')."""
    return _format_rounded(x, decimals, ROUND_FLOOR)


def format_ceil(x: float, decimals: int = 0) -> str:
    """An upper bound for prose: `decimals` places, rounded up, so "at most" never understates it (4.31 -> '5')."""
    return _format_rounded(x, decimals, ROUND_CEILING)


def _format_rounded(x: float, decimals: int, rounding: str) -> str:
    # Decimal(repr) keeps the float's shortest decimal form: 0.29 floors to '0.29', not '0.28'.
    value = Decimal(repr(float(x))).quantize(Decimal(1).scaleb(-decimals), rounding=rounding)
    return f"{value:,.{decimals}f}"


# Bytes per element. fp8/int8 caches also keep small per-block scales; those are not counted here.
_DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
}


def dtype_bytes(dtype: torch.dtype | str | None) -> int:
    """Bytes per element of a torch dtype or one of "fp32", "fp16", "bf16", "fp8", "int8"."""
    # A torch dtype exists only once torch is imported; sizing a registry model never imports it.
    torch_module = sys.modules.get("torch")
    if torch_module is not None and isinstance(dtype, torch_module.dtype):
        return dtype.itemsize
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype or one of {sorted(set(_DTYPE_BYTES))}")
