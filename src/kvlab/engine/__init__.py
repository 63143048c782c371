"""The serving engine: a small vLLM v1 on transformers models, one concept per module (chapters 5-9, 14).

- `config`: `EngineConfig`, every knob in one dataclass.
- `request`: `Request` and `SamplingParams`, one request as the engine tracks it.
- `scheduler`: which requests run each step, with how many tokens; the step's postprocessing.
- `block_manager`: the block allocator, prefix caching, and the contiguous baseline.
- `kv_pool`: the paged KV pool and the attention that reads through block tables.
- `model_runner`: a transformers model's forward and sampling per step; `cost_runner`: no model, a cost.
- `llm_engine`: `LLMEngine`, the one step loop, on either runner.
- `clock`: wall, CPU-time or virtual time; `metrics`: serving metrics under vLLM's names.

`from kvlab.engine import LLMEngine, EngineConfig, Request, SamplingParams` loads torch only on first use, so
that `kvlab --help` and `kvlab size` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.engine.config import EngineConfig
    from kvlab.engine.llm_engine import LLMEngine, RequestOutput
    from kvlab.engine.request import Request, SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "Request", "RequestOutput", "SamplingParams"]

_OWNERS = {
    "EngineConfig": "kvlab.engine.config",
    "LLMEngine": "kvlab.engine.llm_engine",
    "RequestOutput": "kvlab.engine.llm_engine",
    "Request": "kvlab.engine.request",
    "SamplingParams": "kvlab.engine.request",
}


def __getattr__(name: str) -> Any:
    if name in _OWNERS:
        import importlib

        return getattr(importlib.import_module(_OWNERS[name]), name)
    raise AttributeError(f"module 'kvlab.engine' has no attribute {name!r}")
