"""vLLM's defaults, in one table, per release: the settings kvlab sizes a memory budget and an engine with.

Each release kvlab read (`RELEASES`) has its own row, read from that release's wheel; the module constants are
vLLM 0.33.0's (commit g4ba787ec9) where 0.34.0 did not change them. The file and the name each value is set under
stand beside it; the provenance of every row is in tests/test_vllm_defaults.py. `kvlab.costs.budget`,
`kvlab.engine.config.EngineConfig`, `kvlab.planning`, the CLI and the chapters read these names, and no other module
types one of the numbers as a vLLM default (a test checks).

Two of them depend on the GPU and on how vLLM was started (`EngineArgs.get_batch_defaults` and
`_set_default_max_num_seqs_and_batched_tokens_args` in `vllm/engine/arg_utils.py`): the `LLM` class
(`UsageContext.LLM_CLASS`, offline) or `vllm serve` (`UsageContext.OPENAI_API_SERVER`). `batch_defaults`
follows that function, including its rule with chunked prefill off: the step must hold a whole
`max_model_len` prompt, so `max_num_batched_tokens` rises to it, and the memory profile runs at that size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from kvlab.checks import check_count

# The current release: what kvlab sizes with when no version is named.
VLLM_VERSION = "0.34.0"

# vllm/config/cache.py, CacheConfig.gpu_memory_utilization: 0.92 in 0.20.0-0.33.0; 0.34.0 keeps it as
# DEFAULT_GPU_MEMORY_UTILIZATION, what an unset utilisation resolves to with the extensible KV cache off.
GPU_MEMORY_UTILIZATION = 0.92
# 0.34.0's resolved_gpu_memory_utilization with the extensible KV cache on (vllm/config/cache.py).
EXTENSIBLE_GPU_MEMORY_UTILIZATION = 1.0
# vllm/config/cache.py, CacheConfig.DEFAULT_BLOCK_SIZE through 0.33.0, what kvlab's own engine pages with; 0.34.0
# raised it to 64 (`RELEASES`). An attention backend may prefer another size (vllm/platforms/interface.py).
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
# The first release where that default holds (vllm/envs.py: "1" in 0.20.0, "0" in 0.19.0; the log line's
# "default since v0.21.0" is one release late); older logs were sized without the estimate (kvlab.costs.budget).
ESTIMATE_CUDA_GRAPHS_SINCE = (0, 20)
# The v0 engine's default utilisation (vllm/engine/arg_utils.py of 0.6.x, EngineArgs.gpu_memory_utilization;
# documented in vllm-project/vllm#2162), what a v0 start-up log that prints none was sized with.
V0_GPU_MEMORY_UTILIZATION = 0.9
# The v0 engine switched chunked prefill on by default only for a max_model_len above this many tokens
# (vllm/engine/arg_utils.py of 0.6.x, EngineArgs.create_engine_config's long-context rule).
V0_CHUNKED_PREFILL_ABOVE = 32768
# v0's token budget (vllm/config.py of 0.6.4, SchedulerConfig): 512 with chunked prefill, else
# max(max_model_len, 2048); EngineArgs.max_num_seqs 256.
V0_CHUNKED_MAX_NUM_BATCHED_TOKENS = 512
V0_MIN_MAX_NUM_BATCHED_TOKENS = 2048
V0_MAX_NUM_SEQS = 256
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
# 0.19.0-0.22.0 had no 160 GiB row, and kept only A100s off the big one (vllm/engine/arg_utils.py)
BIG_EARLY = BatchTier(
    "big", ">= 70 GiB, not an A100 (H100, H200, B200)", BIG.max_num_batched_tokens, BIG.max_num_seqs
)
TIERS_EARLY = (BIG_EARLY, OTHER)


def batch_tier(
    total_memory_bytes: int, device_name: str = "", tiers: tuple[BatchTier, ...] = TIERS
) -> BatchTier:
    """The row of vLLM's per-GPU table (`tiers`, a release's) for a GPU of `total_memory_bytes` (NVML's total)
    named `device_name`.

    vLLM keeps A100s on the small tier (PR #17885: larger batches lowered its throughput) and GB10, whose
    compute is small for its memory; kvlab knows GB10 by name only (vLLM checks compute capability 12.1)."""
    check_count("total_memory_bytes", total_memory_bytes)
    name = device_name.lower()
    if LARGE in tiers and total_memory_bytes >= 160 * GiB:
        return LARGE
    big = next(t for t in tiers if t.name == "big")
    if total_memory_bytes >= 70 * GiB and "a100" not in name and (big is BIG_EARLY or "gb10" not in name):
        return big
    return OTHER


@dataclass(frozen=True)
class BatchDefaults:
    """The `max_num_batched_tokens` and `max_num_seqs` vLLM starts with, and why."""

    max_num_batched_tokens: int
    max_num_seqs: int
    tier: BatchTier | None  # None: the v0 engine, whose defaults do not depend on the GPU
    usage_context: str
    enable_chunked_prefill: bool
    version: str = VLLM_VERSION  # the release whose rule chose them

    def describe(self) -> str:
        chunked = "" if self.enable_chunked_prefill else ", chunked prefill off: a whole max_model_len prompt"
        if self.tier is None:
            return f"vLLM {self.version}'s v0 defaults{chunked} (vllm/config.py SchedulerConfig)"
        return (
            f"vLLM {self.version}'s default for {USAGE_CONTEXTS[self.usage_context]}, from its per-GPU row "
            f"for {self.tier.applies_to}{chunked} (vllm/engine/arg_utils.py)"
        )


def batch_defaults(
    total_memory_bytes: int,
    device_name: str = "",
    usage_context: str = USAGE_CONTEXT,
    *,
    enable_chunked_prefill: bool = ENABLE_CHUNKED_PREFILL,
    max_model_len: int | None = None,
    release: Release | None = None,
) -> BatchDefaults:
    """`max_num_batched_tokens` and `max_num_seqs` when the user sets neither, by `release`'s rule (the
    current release when None).

    v1 follows `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`: the tier's values for the usage
    context; with chunked prefill off, `max(max_model_len, that)`; then at most `max_num_seqs × max_model_len`
    tokens, and `max_num_seqs` at most the token budget. v0 (`SchedulerConfig` of 0.6.4): 256 sequences and 512
    tokens with chunked prefill, `max(max_model_len, 2048)` without. `max_model_len` is needed with chunked
    prefill off.
    """
    rule = CURRENT if release is None else release
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got {usage_context!r}")
    if max_model_len is not None:
        check_count("max_model_len", max_model_len)
    elif not enable_chunked_prefill:
        raise ValueError("with chunked prefill off, vLLM's token budget depends on max_model_len: pass it")
    if rule.engine == "v0":
        check_count("total_memory_bytes", total_memory_bytes)
        seqs = V0_MAX_NUM_SEQS
        if enable_chunked_prefill:
            tokens = V0_CHUNKED_MAX_NUM_BATCHED_TOKENS
        else:
            assert max_model_len is not None
            tokens = max(max_model_len, V0_MIN_MAX_NUM_BATCHED_TOKENS)
        return BatchDefaults(
            tokens, min(seqs, tokens), None, usage_context, enable_chunked_prefill, rule.version
        )
    tier = batch_tier(total_memory_bytes, device_name, rule.tiers)
    tokens = tier.max_num_batched_tokens[usage_context]
    seqs = tier.max_num_seqs[usage_context]
    if max_model_len is not None:
        if not enable_chunked_prefill:
            tokens = max(max_model_len, tokens)
        tokens = min(seqs * max_model_len, tokens)
    return BatchDefaults(tokens, min(seqs, tokens), tier, usage_context, enable_chunked_prefill, rule.version)


@dataclass(frozen=True)
class Release:
    """How one vLLM release sizes its KV pool at start-up, and its defaults: one row of `RELEASES`.

    `sizing` names the rule `kvlab.costs.budget` applies: "v0" (a whole profiled step, everything outside the
    cache charged), "v1" (profiled step, no CUDA-graph charge), "v1+graphs" (the CUDA-graph estimate charged too),
    "measured" (0.34's extensible cache, sized from memory measured after warmup and graph capture)."""

    version: str
    engine: Literal["v0", "v1"]
    sizing: Literal["v0", "v1", "v1+graphs", "measured"]
    gpu_memory_utilization: float  # what an unset utilisation resolves to
    block_size: int
    tiers: tuple[BatchTier, ...]  # unused by v0, whose defaults do not depend on the GPU
    # what an unset utilisation resolves to with the extensible cache off (the estimate rule's)
    estimate_gpu_memory_utilization: float

    @property
    def estimate_cuda_graphs(self) -> bool:
        """Whether the estimate rule charges CUDA graphs (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS's default)."""
        return self.sizing in ("v1+graphs", "measured")

    @property
    def extensible_kv_cache(self) -> bool:
        """Whether the extensible KV cache is on by default (CUDA and ROCm)."""
        return self.sizing == "measured"

    def chunked_prefill(self, max_model_len: int | None) -> bool:
        """Chunked prefill's default: always on in v1; in v0 only above 32k tokens."""
        if self.engine == "v1":
            return True
        return max_model_len is not None and max_model_len > V0_CHUNKED_PREFILL_ABOVE


# The releases whose source kvlab read (provenance per row in tests/test_vllm_defaults.py), oldest first.
RELEASES = (
    Release("0.6.4", "v0", "v0", V0_GPU_MEMORY_UTILIZATION, BLOCK_SIZE, (), V0_GPU_MEMORY_UTILIZATION),
    Release(
        "0.19.0", "v1", "v1", V0_GPU_MEMORY_UTILIZATION, BLOCK_SIZE, TIERS_EARLY, V0_GPU_MEMORY_UTILIZATION
    ),
    Release(
        "0.20.0", "v1", "v1+graphs", GPU_MEMORY_UTILIZATION, BLOCK_SIZE, TIERS_EARLY, GPU_MEMORY_UTILIZATION
    ),
    Release("0.33.0", "v1", "v1+graphs", GPU_MEMORY_UTILIZATION, BLOCK_SIZE, TIERS, GPU_MEMORY_UTILIZATION),
    # vllm/config/cache.py of 0.34.0: DEFAULT_BLOCK_SIZE 64, utilisation None -> 1.0 with the extensible cache
    Release("0.34.0", "v1", "measured", EXTENSIBLE_GPU_MEMORY_UTILIZATION, 64, TIERS, GPU_MEMORY_UTILIZATION),
)
CURRENT = RELEASES[-1]
# The engine families: v0 (the default engine before 0.8.0) and v1 as first released (0.8.0 to 0.19.x)
FAMILIES = {"v0": RELEASES[0], "v1": RELEASES[1]}
V1_SINCE = (0, 8)
OLDEST = (0, 5)

# vllm/config/vllm.py of 0.34.0, VllmConfig._resolve_extensible_kv_cache: where the estimate rule still sizes
# the cache (then at GPU_MEMORY_UTILIZATION when unset). kvlab's switch: `extensible_kv_cache=False`.
EXTENSIBLE_FALLBACKS = (
    "kv_cache_memory_bytes or num_gpu_blocks_override is set",
    "elastic EP",
    "a KV connector sharing the cache through legacy CUDA IPC, or with its own memory pool",
    "on ROCm, a connector that registers the cache (NIXL, Mooncake, MoRIIO, UMBP)",
    "NIXL on device memory without an IMEX channel",
    "a platform or driver without VMM support",
)


def version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a release name such as "0.20.1rc1.dev16+g7a1eb8ac2"; a one-line ValueError
    when it is not one."""
    found = re.fullmatch(
        r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.\d+)*(?:[.+\-]?(?:post|rc|dev|a|b|\+).*)?", version.strip()
    )
    if not found:
        raise ValueError(
            f"not a vLLM release: {version!r} (e.g. 0.6.3, 0.19.0, 0.34.0, or the family v0 or v1)"
        )
    return tuple(int(part or 0) for part in found.groups())


@dataclass(frozen=True)
class ResolvedRelease:
    """The rule a named version gets, and a note saying which release's source it is read from."""

    asked: str
    release: Release
    note: str


def resolve(version: str | None = None) -> ResolvedRelease:
    """The rule for `version`: a release ("0.6.3", "0.34.0") or a family ("v0", "v1"); None is the current
    release. A release between two that kvlab read gets the nearer older one's rule, and the note says so."""
    if version is None:
        return ResolvedRelease(CURRENT.version, CURRENT, f"vLLM {CURRENT.version}")
    name = version.strip().lower()
    if name in FAMILIES:
        rule = FAMILIES[name]
        era = "before 0.8.0" if name == "v0" else "0.8.0 to 0.19.x"
        return ResolvedRelease(name, rule, f"the {name} engine ({era}): vLLM {rule.version}'s rule")
    wanted = version_tuple(name)
    if wanted[:2] < OLDEST:
        raise ValueError(f"vLLM {version} is older than 0.5, the oldest release kvlab models")
    engine = "v0" if wanted[:2] < V1_SINCE else "v1"
    older = [r for r in RELEASES if r.engine == engine and version_tuple(r.version) <= wanted]
    rule = older[-1] if older else FAMILIES[engine]
    read = version_tuple(rule.version)
    if wanted == read:
        note = f"vLLM {rule.version}"
    elif wanted > read:
        note = f"vLLM {version}: {rule.version}'s rule, the nearest older release kvlab read"
    else:
        note = (
            f"vLLM {version}: the {engine} engine's rule, read from {rule.version} (kvlab read no older one)"
        )
    return ResolvedRelease(version, rule, note)


def describe(setting: str) -> str:
    """One setting's default and the file it is set in, e.g. "0.92 (vllm/config/cache.py)"."""
    found = {name: f"{value} ({where})" for name, value, where in rows()}
    if setting not in found:
        raise ValueError(f"no vLLM default recorded for {setting!r}; known: {', '.join(found)}")
    return found[setting]


def rows() -> list[tuple[str, str, str]]:
    """(setting, the current release's default, where it is set): the table as the chapters and `EngineConfig`
    show it; where 0.34.0 changed a default, the row gives 0.33.0's too."""
    per_gpu = "; ".join(
        f"{t.applies_to}: {t.max_num_batched_tokens['serve']} serve / {t.max_num_batched_tokens['llm']} LLM class"
        for t in TIERS
    )
    seqs = "; ".join(f"{t.applies_to}: {t.max_num_seqs['serve']}" for t in TIERS)
    return [
        (
            "gpu_memory_utilization",
            f"unset: {EXTENSIBLE_GPU_MEMORY_UTILIZATION:g} with the extensible KV cache (on by default on CUDA "
            f"from 0.34.0), {GPU_MEMORY_UTILIZATION} without it and through 0.33.0",
            "vllm/config/cache.py",
        ),
        (
            "block_size",
            f"{CURRENT.block_size} from 0.34.0, {BLOCK_SIZE} through 0.33.0 (an attention backend may choose another)",
            "vllm/config/cache.py",
        ),
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
