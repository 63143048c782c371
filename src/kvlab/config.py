"""`EngineConfig`: every knob of `LLMEngine` in one dataclass, like vLLM's `EngineArgs` and `SchedulerConfig`.

`LLMEngine(model, block_size=16, ...)` builds one from its keywords, as vLLM's `LLM(...)` builds its `EngineArgs`;
`LLMEngine(model, EngineConfig(...))` takes one directly. `num_blocks=None` sizes the pool from a memory budget
(see `ModelRunner.profile_num_blocks`); `max_model_len=None` is the model's limit, capped by the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlab.scheduler import SchedulerConfig, Scheduling

KVLayout = Literal["paged", "contiguous"]


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as the memory budget leaves
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = False
    scheduling: Scheduling = "continuous"
    max_model_len: int | None = None  # None: the model's limit, capped by the pool
    memory_budget_bytes: int | None = None  # None: 256 MiB on CPU, 90% of the device memory on a GPU
    kv_layout: KVLayout = "paged"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        if self.kv_layout == "contiguous" and self.enable_prefix_caching:
            raise ValueError("the contiguous baseline has no prefix caching")
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError(
                f"block_size and num_blocks must be >= 1, got {self.block_size}, {self.num_blocks}"
            )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's share of the knobs, once `max_model_len` is resolved against the pool."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            scheduling=self.scheduling,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
