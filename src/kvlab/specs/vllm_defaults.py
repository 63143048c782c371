"""vLLM 0.33.0's defaults, in one table: the settings kvlab sizes a memory budget and an engine with.

Every value is read from the vLLM 0.33.0 wheel's source (commit g4ba787ec9); the file and the name it is set
under stand beside it. `kvlab.costs.budget`, `kvlab.engine.config.EngineConfig`, `kvlab.planning.plan`, `kvlab.planning.diagnose`, the CLI and
the chapters read these names, and no other module types one of the numbers as a vLLM default (a test checks).

Two of them depend on the GPU and on how vLLM was started (`EngineArgs.get_batch_defaults` and
`_set_default_max_num_seqs_and_batched_tokens_args` in `vllm/engine/arg_utils.py`): the `LLM` class
(`UsageContext.LLM_CLASS`, offline) or `vllm serve` (`UsageContext.OPENAI_API_SERVER`). `batch_defaults`
follows that function, including its rule with chunked prefill off: the step must hold a whole
`max_model_len` prompt, so `max_num_batched_tokens` rises to it, and the memory profile runs at that size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlab.checks import check_count

VLLM_VERSION = "0.33.0"

# vllm/config/cache.py, CacheConfig.gpu_memory_utilization: Field(default=0.92, gt=0, le=1).
GPU_MEMORY_UTILIZATION = 0.92
# vllm/config/cache.py, CacheConfig.DEFAULT_BLOCK_SIZE; an attention backend may prefer another size
# (vllm/platforms/interface.py, "Setting kv cache block size to %d").
BLOCK_SIZE = 16
# vllm/config/cache.py, CacheConfig.enable_prefix_caching (on for every model that supports it).
ENABLE_PREFIX_CACHING = True
# vllm/config/scheduler.py, SchedulerConfig.enable_chunked_prefill.
ENABLE_CHUNKED_PREFILL = True
# vllm/config/scheduler.py, SchedulerConfig.scheduler_reserve_full_isl: admit only when the whole prompt fits.
SCHEDULER_RESERVE_FULL_ISL = True
# vllm/config/cache.py, CacheConfig.prefix_cache_retention_interval: 0 keeps only the sliding-window blocks
# reachable at replay boundaries.
PREFIX_CACHE_RETENTION_INTERVAL = 0
# vllm/config/cache.py, CacheConfig.cache_dtype: "auto" stores the model's dtype.
KV_CACHE_DTYPE = "auto"
# vllm/envs.py, VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to "1": the CUDA-graph estimate is
# subtracted from the KV memory (vllm/v1/worker/gpu_worker.py, determine_available_memory).
ESTIMATE_CUDA_GRAPHS = True
# The first release where that default holds; older logs were sized without the estimate (kvlab.costs.budget).
ESTIMATE_CUDA_GRAPHS_SINCE = (0, 21)
# The v0 engine's default utilisation (vllm/engine/arg_utils.py of 0.6.x, EngineArgs.gpu_memory_utilization;
# documented in vllm-project/vllm#2162), what a v0 start-up log that prints none was sized with.
V0_GPU_MEMORY_UTILIZATION = 0.9
# The v0 engine switched chunked prefill on by default only for a max_model_len above this many tokens
# (vllm/engine/arg_utils.py of 0.6.x, EngineArgs.create_engine_config's long-context rule).
V0_CHUNKED_PREFILL_ABOVE = 32768
# vllm/config/vllm.py, VllmConfig._set_cudagraph_sizes: graphs are captured up to min(2 × max_num_seqs, 512)
# tokens (1024 on data-centre Blackwell), and never above max_num_batched_tokens.
MAX_CUDAGRAPH_CAPTURE_SIZE = 512
# vllm/config/scheduler.py, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS / DEFAULT_MAX_NUM_SEQS: what a usage
# context without an entry in the per-GPU table gets.
SCHEDULER_MAX_NUM_BATCHED_TOKENS = 2048
SCHEDULER_MAX_NUM_SEQS = 128

UsageContext = Literal["serve", "llm"]
USAGE_CONTEXTS: dict[str, str] = {
    "serve": "vllm serve (UsageContext.OPENAI_API_SERVER)",
    "llm": "the LLM class (UsageContext.LLM_CLASS)",
}
# What kvlab assumes when nothing is said: readers compare with a server's start-up log.
USAGE_CONTEXT: UsageContext = "serve"

GiB = 2**30


@dataclass(frozen=True)
class BatchTier:
    """One row of `EngineArgs.get_batch_defaults`: the GPUs it covers and its two defaults per usage context."""

    name: str
    applies_to: str
    max_num_batched_tokens: dict[str, int]
    max_num_seqs: dict[str, int]


# vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults. The memory is NVML's total
# (vllm/platforms/cuda.py get_device_total_memory), the figure nvidia-smi prints and `kvlab.specs.hardware` stores.
LARGE = BatchTier(
    "large", ">= 160 GiB (B200, B300)", {"llm": 16384, "serve": 16384}, {"llm": 1024, "serve": 1024}
)
BIG = BatchTier(
    "big",
    ">= 70 GiB, not an A100 or GB10 (H100, H200)",
    {"llm": 16384, "serve": 8192},
    {"llm": 1024, "serve": 1024},
)
OTHER = BatchTier("other", "every other GPU", {"llm": 8192, "serve": 2048}, {"llm": 256, "serve": 256})
TIERS = (LARGE, BIG, OTHER)


def batch_tier(total_memory_bytes: int, device_name: str = "") -> BatchTier:
    """The row of vLLM's per-GPU table for a GPU of `total_memory_bytes` (NVML's total) named `device_name`.

    vLLM keeps A100s on the small tier (PR #17885: larger batches lowered its throughput) and GB10, whose
    compute is small for its memory; kvlab knows GB10 by name only (vLLM checks compute capability 12.1)."""
    check_count("total_memory_bytes", total_memory_bytes)
    name = device_name.lower()
    if total_memory_bytes >= 160 * GiB:
        return LARGE
    if total_memory_bytes >= 70 * GiB and "a100" not in name and "gb10" not in name:
        return BIG
    return OTHER


@dataclass(frozen=True)
class BatchDefaults:
    """The `max_num_batched_tokens` and `max_num_seqs` vLLM starts with, and why."""

    max_num_batched_tokens: int
    max_num_seqs: int
    tier: BatchTier
    usage_context: str
    enable_chunked_prefill: bool

    def describe(self) -> str:
        chunked = "" if self.enable_chunked_prefill else ", chunked prefill off: a whole max_model_len prompt"
        return (
            f"vLLM {VLLM_VERSION}'s default for {USAGE_CONTEXTS[self.usage_context]}, from its per-GPU row "
            f"for {self.tier.applies_to}{chunked} (vllm/engine/arg_utils.py)"
        )


def batch_defaults(
    total_memory_bytes: int,
    device_name: str = "",
    usage_context: str = USAGE_CONTEXT,
    *,
    enable_chunked_prefill: bool = ENABLE_CHUNKED_PREFILL,
    max_model_len: int | None = None,
) -> BatchDefaults:
    """vLLM 0.33.0's `max_num_batched_tokens` and `max_num_seqs` when the user sets neither.

    Follows `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`: the tier's values for the usage
    context; with chunked prefill off, `max(max_model_len, that)`; then at most `max_num_seqs × max_model_len`
    tokens, and `max_num_seqs` at most the token budget. `max_model_len` is needed with chunked prefill off.
    """
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got {usage_context!r}")
    if max_model_len is not None:
        check_count("max_model_len", max_model_len)
    elif not enable_chunked_prefill:
        raise ValueError("with chunked prefill off, vLLM's token budget depends on max_model_len: pass it")
    tier = batch_tier(total_memory_bytes, device_name)
    tokens = tier.max_num_batched_tokens[usage_context]
    seqs = tier.max_num_seqs[usage_context]
    if max_model_len is not None:
        if not enable_chunked_prefill:
            tokens = max(max_model_len, tokens)
        tokens = min(seqs * max_model_len, tokens)
    return BatchDefaults(tokens, min(seqs, tokens), tier, usage_context, enable_chunked_prefill)


def describe(setting: str) -> str:
    """One setting's default and the file it is set in, e.g. "0.92 (vllm/config/cache.py)"."""
    found = {name: f"{value} ({where})" for name, value, where in rows()}
    if setting not in found:
        raise ValueError(f"no vLLM default recorded for {setting!r}; known: {', '.join(found)}")
    return found[setting]


def rows() -> list[tuple[str, str, str]]:
    """(setting, vLLM 0.33.0's default, where it is set): the table as the chapters and `EngineConfig` show it."""
    per_gpu = "; ".join(
        f"{t.applies_to}: {t.max_num_batched_tokens['serve']} serve / {t.max_num_batched_tokens['llm']} LLM class"
        for t in TIERS
    )
    seqs = "; ".join(f"{t.applies_to}: {t.max_num_seqs['serve']}" for t in TIERS)
    return [
        ("gpu_memory_utilization", f"{GPU_MEMORY_UTILIZATION}", "vllm/config/cache.py"),
        ("block_size", f"{BLOCK_SIZE} (an attention backend may choose another)", "vllm/config/cache.py"),
        ("enable_prefix_caching", f"{ENABLE_PREFIX_CACHING}", "vllm/config/cache.py"),
        ("enable_chunked_prefill", f"{ENABLE_CHUNKED_PREFILL}", "vllm/config/scheduler.py"),
        ("scheduler_reserve_full_isl", f"{SCHEDULER_RESERVE_FULL_ISL}", "vllm/config/scheduler.py"),
        ("prefix_cache_retention_interval", f"{PREFIX_CACHE_RETENTION_INTERVAL}", "vllm/config/cache.py"),
        ("kv_cache_dtype", f"{KV_CACHE_DTYPE}: the model's dtype", "vllm/config/cache.py"),
        (
            "max_num_batched_tokens",
            f"{per_gpu}; chunked prefill off: at least max_model_len",
            "vllm/engine/arg_utils.py get_batch_defaults",
        ),
        ("max_num_seqs", seqs, "vllm/engine/arg_utils.py get_batch_defaults"),
        ("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", f"{int(ESTIMATE_CUDA_GRAPHS)}", "vllm/envs.py"),
    ]
