"""kvlab: measure why the KV cache fills GPU memory during LLM inference, and what helps.

Packages, from the bottom layer up (docs/modules.md maps every module to its chapters):
`specs` (architectures, sizing, GPUs, vLLM's defaults: chapters 2, 4), `models` (tiny and real transformers
models), `costs` (memory budget, roofline: chapters 3-6), `engine` (the paged engine: chapters 5-9), `offload`
(chapter 12), `disagg` (prefill and decode on two engines, K/V moved between: chapter 17), `planning`
(simulator, `kvlab plan`, `kvlab diagnose`, routing, cluster layouts: chapters 14, 15, 17), `experiments` (the
chapters' measurements on real models: 1, 3, 4, 8-11, 13) and `book` (figures, tables, sweeps, GPU runs).

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
