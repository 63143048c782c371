"""kvlab: measure why the KV cache fills GPU memory during LLM inference, and what helps.

Modules map to book chapters: `arch` and `sizing` (sizing the cache), `models` and `measure` (what the cache
holds), `hardware` (spec sheets), `plot` (one figure style), `cli` (`kvlab size ...`).

`kvlab.env_report` and `kvlab.pick_device` load `kvlab.env` (and torch) on first use, so that `import kvlab`
and `kvlab --help` do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlab.version import __version__

if TYPE_CHECKING:
    from kvlab.env import env_report, pick_device

__all__ = ["__version__", "env_report", "pick_device"]


def __getattr__(name: str) -> Any:
    if name in ("env_report", "pick_device"):
        from kvlab import env

        return getattr(env, name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
