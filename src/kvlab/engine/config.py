"""`EngineConfig`: every knob of `LLMEngine` in one dataclass (vLLM's `EngineArgs`), and the scheduler's share.

`LLMEngine(model, block_size=16, ...)` builds one from keywords, as vLLM's `LLM(...)` builds its `EngineArgs`.
`num_blocks=None` sizes the pool from a memory budget; `max_model_len=None` is the model's limit, capped by the
pool. Defaults follow vLLM v1 (`kvlab.specs.vllm_defaults`) where they suit a teaching engine: prefix caching
and chunked prefill on. They differ where vLLM sizes for a datacentre GPU (`max_num_seqs`,
`max_num_batched_tokens`), and admission needs only the first chunk's blocks unless
`scheduler_reserve_full_isl=True`. `EngineConfig.table()` puts both side by side. Chapters 7-9.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from kvlab.kv_format import pool_format
from kvlab.specs import vllm_defaults
from kvlab.units import cdiv

KVLayout = Literal["paged", "contiguous"]
Scheduling = Literal["continuous", "static"]


def check_retention_interval(interval: int | None, block_size: int) -> None:
    """vLLM's `prefix_cache_retention_interval` values: None, 0, or a positive multiple of the block size."""
    if interval is None:
        return
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0 or interval % block_size:
        raise ValueError(
            f"prefix_cache_retention_interval must be None, 0 or a positive multiple of block_size={block_size},"
            f" got {interval!r}"
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's share of the knobs, `max_model_len` resolved (vLLM's `SchedulerConfig`)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    scheduling: Scheduling = "continuous"
    enable_chunked_prefill: bool = True
    reserve_full_prompt: bool = False  # vLLM's scheduler_reserve_full_isl

    def __post_init__(self) -> None:
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    @property
    def max_idle_steps(self) -> int:
        """Steps without progress that a live schedule can need: one preemption-only step per running request,
        then the oldest re-admitted request recomputing, the whole token budget a step, up to `max_model_len`."""
        return self.max_num_seqs + cdiv(self.max_model_len, self.max_num_batched_tokens) + 2


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


# vLLM's default for each knob, from the one table of them (`kvlab.specs.vllm_defaults`, which cites each file)
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
