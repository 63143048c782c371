"""kvlab: measure why the KV cache fills GPU memory during LLM inference, and what helps.

Modules map to book chapters: `arch` and `sizing` (sizing the cache), `models` and `measure` (what the cache
holds), `hardware` (spec sheets), `plot` (one figure style), `cli` (`kvlab size ...`).
"""

from kvlab.env import env_report, pick_device

__version__ = "0.1.0"
__all__ = ["__version__", "env_report", "pick_device"]
