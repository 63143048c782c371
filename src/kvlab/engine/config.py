"""`EngineConfig`: every knob of `LLMEngine` in one dataclass, like vLLM's `EngineArgs` and `SchedulerConfig`.

`LLMEngine(model, block_size=16, ...)` builds one from its keywords, as vLLM's `LLM(...)` builds its `EngineArgs`;
`LLMEngine(model, EngineConfig(...))` takes one directly. `num_blocks=None` sizes the pool from a memory budget
(see `ModelRunner.profile_num_blocks`); `max_model_len=None` is the model's limit, capped by the pool.

Defaults follow vLLM v1 (0.33.0, `vllm/config/cache.py`, `vllm/config/scheduler.py`) where they make sense for
a teaching engine: prefix caching on (off for the contiguous baseline, which cannot share), chunked prefill on,
and `prefix_cache_retention_interval=0` (sliding-window groups cache only the blocks a hit can reach; see
`kvlab.engine.block_manager`). They differ where vLLM sizes for a datacentre GPU: `max_num_seqs` and
`max_num_batched_tokens` are CPU-sized, and admission needs only the first chunk's blocks unless
`scheduler_reserve_full_isl=True` (vLLM's default, which needs the whole prompt's blocks free, a sliding-window
group counted at most at its window plus the tokens in flight). `VLLM_DEFAULTS` and `EngineConfig.table()` put
both side by side; `LLMEngine` logs that table at startup.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from kvlab.engine.block_manager import check_retention_interval
from kvlab.engine.scheduler import SchedulerConfig, Scheduling
from kvlab.kv_format import pool_format
from kvlab.specs import vllm_defaults

KVLayout = Literal["paged", "contiguous"]


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = vllm_defaults.BLOCK_SIZE
    num_blocks: int | None = None  # None: as many as the memory budget leaves
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool | None = None  # None: on for the paged layout, off for the contiguous one
    scheduling: Scheduling = "continuous"
    max_model_len: int | None = None  # None: the model's limit, capped by the pool
    memory_budget_bytes: int | None = None  # None: 256 MiB on CPU, vLLM's gpu_memory_utilization on a GPU
    kv_layout: KVLayout = "paged"
    enable_chunked_prefill: bool = vllm_defaults.ENABLE_CHUNKED_PREFILL
    scheduler_reserve_full_isl: bool = False  # True: admit only when the whole prompt's blocks are free
    # Sliding-window prefix-cache retention (vLLM's knob): 0 keeps the blocks a resent prompt or a shared-prefix
    # junction can hit, a positive multiple of block_size also one window per interval, None every full block.
    prefix_cache_retention_interval: int | None = vllm_defaults.PREFIX_CACHE_RETENTION_INTERVAL
    kv_cache_dtype: str = (
        "auto"  # "auto": the model's dtype; "fp8" (e4m3) or "int8": 1 byte + scales (kvlab.experiments.quant)
    )

    def __post_init__(self) -> None:
        pool_format(self.kv_cache_dtype)  # a ValueError naming the known dtypes
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", self.kv_layout == "paged")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        if self.kv_layout == "contiguous" and self.enable_prefix_caching:
            raise ValueError("the contiguous baseline has no prefix caching")
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError(
                f"block_size and num_blocks must be >= 1, got {self.block_size}, {self.num_blocks}"
            )
        check_retention_interval(self.prefix_cache_retention_interval, self.block_size)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's share of the knobs, once `max_model_len` is resolved against the pool."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            scheduling=self.scheduling,
            enable_chunked_prefill=self.enable_chunked_prefill,
            reserve_full_prompt=self.scheduler_reserve_full_isl,
        )

    def table(self) -> list[tuple[str, str, str]]:
        """(knob, this engine's value, vLLM v1's default and where it is set), one row per knob."""
        return [(f.name, repr(getattr(self, f.name)), VLLM_DEFAULTS[f.name]) for f in fields(self)]


# vLLM 0.33.0's defaults, read from its source: vllm/config/cache.py (block_size, enable_prefix_caching,
# gpu_memory_utilization), vllm/config/scheduler.py (enable_chunked_prefill, scheduler_reserve_full_isl,
# policy), vllm/engine/arg_utils.py (per-GPU max_num_seqs / max_num_batched_tokens).
VLLM_DEFAULTS: dict[str, str] = {
    "block_size": vllm_defaults.describe("block_size"),
    "num_blocks": (
        f"CUDA's total × gpu_memory_utilization ({vllm_defaults.describe('gpu_memory_utilization')}) − weights"
        " − activation peak − non-torch − CUDA graphs (kvlab.costs.budget)"
    ),
    "max_num_seqs": vllm_defaults.describe("max_num_seqs"),
    "max_num_batched_tokens": vllm_defaults.describe("max_num_batched_tokens"),
    "enable_prefix_caching": vllm_defaults.describe("enable_prefix_caching"),
    "scheduling": "continuous; --scheduling-policy fcfs (vllm/config/scheduler.py)",
    "max_model_len": "the model's max_position_embeddings",
    "memory_budget_bytes": "--kv-cache-memory-bytes unset: sized from gpu_memory_utilization",
    "kv_layout": "paged (vLLM has no contiguous layout)",
    "enable_chunked_prefill": vllm_defaults.describe("enable_chunked_prefill"),
    "scheduler_reserve_full_isl": vllm_defaults.describe("scheduler_reserve_full_isl"),
    "prefix_cache_retention_interval": vllm_defaults.describe("prefix_cache_retention_interval"),
    "kv_cache_dtype": vllm_defaults.describe("kv_cache_dtype"),
}
