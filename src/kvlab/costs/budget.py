"""The memory budget: what is left for KV blocks once everything else has taken its share of the GPU.

One rule per vLLM release (`kvlab.specs.vllm_defaults.RELEASES`; `vllm_version` picks one, the current release
0.34.0 by default). Each rule is read from that release's source; the provenance is in tests/test_budget.py.

- **Estimate rules** (v0, v1, and 0.20-0.33 with the CUDA-graph charge): vLLM snapshots memory once CUDA and
  NCCL are up, requests `ceil(CUDA's total × gpu_memory_utilization)`, profiles one dummy step and keeps
  `requested - (weights + non-torch growth) - activation peak - CUDA-graph estimate` for the cache. v0 charges
  all memory outside PyTorch, the CUDA context included, and profiles a whole `max_model_len` prompt when chunked
  prefill is off (its default up to 32k tokens); v1 before 0.20 charges no graphs.
- **Measured rule** (0.34's extensible cache, on by default on CUDA): the cache is sized after warmup and graph
  capture: `min(requested - used, headroom - margin) - transient`, with `headroom` the memory free after the
  context and everything vLLM keeps, `margin = max(1 GiB, 0.75 × transient)` and `transient` the profiled peak
  plus the graph estimate; blocks are rounded to the VMM granule. `extensible_kv_cache=False` is 0.34's fallback
  (a set `kv_cache_memory_bytes`, legacy-IPC connectors, no VMM: `vllm_defaults.EXTENSIBLE_FALLBACKS`).

Two pools come out. `kv_pool_bytes` is the **expected** pool: every estimated term at its central value
(`CENTRAL`, calibrated on half of tests/data/vllm_logs; `kvlab.planning.accuracy`). `kv_pool_floor_bytes` is a
**lower bound**: every term at an estimate above each published measurement (`FLOOR`). The appendix page
*How close kvlab's pool comes to vLLM's* (book/appendix_accuracy) gives both against every collected log.

`MemoryBudget` is the one place a KV budget is computed: `kvlab size --gpu`, the chapters' "N sequences fit"
figures and the engine's pool all come from it. Chapters: *Active tokens, not batch size* (book/05_active_tokens),
*Long context* (book/06_long_context).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.checks import check_count
from kvlab.specs import hardware, vllm_defaults
from kvlab.specs.shape import prepare, shape
from kvlab.specs.sizing import sequence_slots
from kvlab.units import GiB, MiB, cdiv, dtype_bytes, format_bytes, format_tokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvlab.specs.images import ImageCost

GPU_MEMORY_UTILIZATION = vllm_defaults.GPU_MEMORY_UTILIZATION
BLOCK_SIZE = vllm_defaults.BLOCK_SIZE
# What kvlab's own engine and the activation estimate assume when no GPU says otherwise: vLLM's defaults on a
# GPU of the "other" tier, as `vllm serve` starts (kvlab.specs.vllm_defaults.batch_defaults).
MAX_NUM_BATCHED_TOKENS = vllm_defaults.OTHER.max_num_batched_tokens["llm"]
MAX_NUM_SEQS = vllm_defaults.OTHER.max_num_seqs["serve"]
CUDA_CONTEXT_BYTES = 781 * MiB  # nvidia-smi after CUDA init in PyTorch (pytorch/pytorch#34323)
DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")  # the weight and KV precisions `BudgetSettings` takes

# 0.34's extensible cache (vllm/v1/worker/extensible_kv_cache.py): the margin's floor and share of the transient
# peak (3 GiB on ROCm; kvlab models CUDA), and the VMM granule a commit is rounded to per segment (2 MiB,
# cuMemGetAllocationGranularity's minimum on current NVIDIA GPUs).
KV_CACHE_MARGIN_FLOOR_BYTES = 1 * GiB
KV_CACHE_MARGIN_FRACTION = 0.75
VMM_GRANULE_BYTES = 2 * MiB


@dataclass(frozen=True)
class Estimates:
    """kvlab's estimate of each term vLLM measures at start-up; `FLOOR` and `CENTRAL` are the two sets."""

    driver_reserved_bytes: int  # NVML's total less CUDA's
    non_torch_tp1_bytes: int  # memory outside PyTorch the profile adds, one GPU
    non_torch_tp_bytes: int  # the same at TP >= 2 where NCCL runs NVLS (Accelerator.nvls: HGX Hopper, later)
    non_torch_tp_no_nvls_bytes: int  # the same at TP >= 2 elsewhere (A100, PCIe, GeForce): no NVLS buffers
    context_tp1_bytes: int  # in use before vLLM's snapshot (CUDA context, cuBLAS): charged by 0.34 and v0
    context_tp_bytes: int  # the same at TP >= 2 (NCCL communicators come up first)
    sampler_bytes_per_logit: int  # the sampler's dummy batch, per logit alive at its peak, before vLLM 0.17
    sampler_bytes_per_logit_017: int  # the same from 0.17, whose profiled activation peak fell by about 60 %
    cuda_graph_bytes: int  # one captured graph beyond the first
    forward_percent: int  # the forward's activation estimate, as a share of `activation_workspace_bytes`

    def non_torch(self, tp: int, nvls: bool = True) -> int:
        if check_count("tp", tp) == 1:
            return self.non_torch_tp1_bytes
        return self.non_torch_tp_bytes if nvls else self.non_torch_tp_no_nvls_bytes

    def context(self, tp: int) -> int:
        return self.context_tp1_bytes if check_count("tp", tp) == 1 else self.context_tp_bytes

    def sampler_rate(self, version: tuple[int, ...]) -> int:
        """Bytes per logit of the sampler's dummy batch at vLLM `version` (major, minor, ...)."""
        return (
            self.sampler_bytes_per_logit_017
            if version[:2] >= SAMPLER_SHRANK_IN
            else self.sampler_bytes_per_logit
        )


# The release whose profiled activation peak fell by about 60 % (llm-d-incubation/llm-d-planner,
# accuracy/accuracy_report.md, "vLLM Version Sensitivity": Qwen3-14B at 1,024 sampled rows, 5.64 GiB in 0.16.0,
# 2.23 GiB in 0.17.0: 39 and 15 bytes per logit of its 151,936-token vocabulary).
SAMPLER_SHRANK_IN = (0, 17)


# Each term above every measurement kvlab has, so the pool is a lower bound:
# - driver reserve: 430 MiB on an RTX 3090 (23.58 GiB printed by vLLM, tests/data/vllm_logs), 479 MiB on an H100
#   80GB (79.18 GiB, llm-d/llm-d-benchmark), 494 MiB on an RTX PRO 4500 (vllm-project/vllm#51590);
# - non-torch: 0.05-0.35 GiB measured at TP=1, about 2.1 GiB per GPU at TP >= 2, in tests/data/vllm_logs and
#   kvlab issue 21, on H100s with NVLS; without NVLS kvlab has no measurement above that, so the floor keeps it;
#   the context: pytorch/pytorch#34323's 781 MiB, NCCL's buffers beside it at TP >= 2;
# - sampler: 0.33's Triton top-k/top-p path holds the bf16 logits (2), their fp32 copy (4), the probabilities (4)
#   and the exponential noise (4) (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py); the PyTorch path sorts:
#   values (4) and int64 indices (8) more. A v1 log measured 4.76 GiB for Llama-3.1-8B at 1,024 rows of 128,256
#   logits, 39 B a logit (llm-d/llm-d-benchmark, config_explorer/empirical-vllm-memory-results.md): 40;
# - graphs: about 24 MiB for a FULL graph (vllm-project/vllm#50780), 23 MiB averaged over 16 PIECEWISE graphs
#   (gpustack/runner#251: 0.36 GiB).
FLOOR = Estimates(
    driver_reserved_bytes=512 * MiB,
    non_torch_tp1_bytes=512 * MiB,
    non_torch_tp_bytes=2304 * MiB,
    non_torch_tp_no_nvls_bytes=2304 * MiB,
    context_tp1_bytes=CUDA_CONTEXT_BYTES,
    context_tp_bytes=CUDA_CONTEXT_BYTES + 512 * MiB,
    sampler_bytes_per_logit=40,
    sampler_bytes_per_logit_017=40,
    cuda_graph_bytes=24 * MiB,
    forward_percent=100,
)
# Central values, fitted on the calibration half of tests/data/vllm_logs (kvlab.planning.accuracy.calibrate;
# the page book/appendix_accuracy gives the fit and the held-out error). Not fitted to pools: the driver reserve
# (the mean of the three measurements above), the context at TP >= 2, and the graphs, 8 MiB a capture beyond
# the first: Llama-3.1-8B's 0.84 GiB over its 102 captures on an H100 (llm-d/llm-d-benchmark,
# config_explorer/empirical-vllm-memory-results.md), since few logs charge graphs to their pool.
CENTRAL = Estimates(
    driver_reserved_bytes=468 * MiB,
    non_torch_tp1_bytes=64 * MiB,
    non_torch_tp_bytes=1536 * MiB,
    non_torch_tp_no_nvls_bytes=64 * MiB,
    context_tp1_bytes=256 * MiB,
    context_tp_bytes=1024 * MiB,
    sampler_bytes_per_logit=38,
    sampler_bytes_per_logit_017=16,
    cuda_graph_bytes=8 * MiB,
    forward_percent=90,
)
# The module's historical names for the floor's terms
DRIVER_RESERVED_BYTES = FLOOR.driver_reserved_bytes
NON_TORCH_BYTES_TP1 = FLOOR.non_torch_tp1_bytes
NON_TORCH_BYTES_TP = FLOOR.non_torch_tp_bytes
SAMPLER_BYTES_PER_LOGIT = FLOOR.sampler_bytes_per_logit
CUDA_GRAPH_BYTES = FLOOR.cuda_graph_bytes


def non_torch_bytes(tp: int = 1, estimates: Estimates = FLOOR, nvls: bool = True) -> int:
    """Estimated memory outside PyTorch that vLLM charges per GPU at `tp` tensor-parallel ranks, on GPUs where
    NCCL runs NVLS (`nvls`, `kvlab.specs.hardware.Accelerator.nvls`) or not."""
    return estimates.non_torch(tp, nvls)


def cuda_graph_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The token counts vLLM 0.33 captures a graph for by default (`VllmConfig._set_cudagraph_sizes`): 1, 2, 4,
    then every 8 up to 248 and every 16 from 256, up to min(2 × max_num_seqs, 512, max_num_batched_tokens)."""
    largest = min(2 * max_num_seqs, vllm_defaults.MAX_CUDAGRAPH_CAPTURE_SIZE, max_num_batched_tokens)
    sizes = [n for n in (1, 2, 4) if n <= largest]
    sizes += list(range(8, min(largest + 1, 256), 8)) + list(range(256, largest + 1, 16))
    if max_num_batched_tokens <= largest and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    return sorted(sizes)


def cuda_graph_bytes(
    config: PretrainedConfig | str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    dtype: str = "bf16",
    tp: int = 1,
    estimates: Estimates = FLOOR,
) -> int:
    """Estimated CUDA-graph memory as vLLM 0.33 subtracts it (`GPUModelRunner.profile_cudagraph_memory`).

    vLLM's default mode, FULL_AND_PIECEWISE, captures a PIECEWISE graph for every size of `cuda_graph_sizes`
    and a FULL graph for every decode batch up to `max_num_seqs`; per mode it counts its first capture whole
    and the second one once per further graph, then overlays the two modes' first captures (max). kvlab takes
    the first capture as the forward peak at the largest size and `estimates.cuda_graph_bytes` per further
    graph."""
    sizes = cuda_graph_sizes(max_num_seqs, max_num_batched_tokens)
    decode = [n for n in sizes if n <= max_num_seqs]
    first = forward_peak_bytes(config, sizes[-1], dtype, tp=tp, estimates=estimates)
    return first + estimates.cuda_graph_bytes * (len(sizes) - 1 + max(len(decode) - 1, 0))


def sampler_peak_bytes(
    config: PretrainedConfig | str,
    num_seqs: int,
    estimates: Estimates = FLOOR,
    version: tuple[int, ...] = vllm_defaults.version_tuple(vllm_defaults.VLLM_VERSION),
) -> int:
    """Estimated peak of vLLM's `_dummy_sampler_run` at `version`: `num_seqs` rows of logits over the whole
    vocabulary (every TP rank gathers them), `estimates.sampler_rate(version)` bytes each."""
    rate = estimates.sampler_rate(version)
    return check_count("num_seqs", num_seqs) * shape(config).vocab_size * rate


def forward_peak_bytes(
    config: PretrainedConfig | str,
    num_tokens: int,
    dtype: str = "bf16",
    tp: int = 1,
    estimates: Estimates = FLOOR,
) -> int:
    """Estimated activation peak of vLLM's dummy forward over `num_tokens` tokens: `activation_workspace_bytes`
    with one sampled row (the logits belong to the sampler's run), at `estimates.forward_percent` of it."""
    return activation_workspace_bytes(config, num_tokens, 1, dtype, tp=tp) * estimates.forward_percent // 100


@dataclass(frozen=True)
class MemoryBudget:
    """Where a device's memory goes, term by term, and how many KV blocks the rest holds."""

    capacity_bytes: int
    gpu_memory_utilization: float
    runtime_bytes: int  # memory outside PyTorch's allocator charged to the engine (vLLM's non-torch increase)
    weight_bytes: int
    activation_bytes: int  # peak activation workspace of the largest step
    block_size: int  # tokens per block
    kv_bytes_per_token: int  # all layers, while every layer still grows
    runtime_source: str = f"default {format_bytes(CUDA_CONTEXT_BYTES)} (pytorch/pytorch#34323)"
    activation_source: str = "estimate (kvlab.costs.budget.activation_workspace_bytes)"
    driver_reserved_bytes: int = 0  # NVML's total less CUDA's: vLLM's utilisation applies to CUDA's
    driver_reserved_source: str = "none counted"
    sampler_bytes: int = 0  # the sampler's dummy batch; it runs after the forward, so the peak is the larger
    sampler_source: str = "none counted"
    cuda_graph_bytes: int = 0
    cuda_graph_source: str = "none counted"
    settings_note: str = ""  # the token budget and batch the estimates assume, and where they come from
    # Speculative decoding (all 0 / empty when off): the drafter's weights, its share of `kv_bytes_per_token`,
    # K, the slots a running sequence holds beyond its tokens, and the max_model_len that caps them.
    draft_weight_bytes: int = 0
    draft_weight_source: str = "none counted"
    draft_kv_bytes_per_token: int = 0
    draft_kv_source: str = ""
    speculative_tokens: int = 0
    lookahead_slots: int = 0
    max_model_len: int | None = None
    # An image-text model's vision embeddings, which vLLM's profile run holds in its encoder cache while the
    # decoder's dummy forward and the sampler run (kvlab.specs.images.ImageCost.encoder_cache_bytes); 0: none.
    encoder_cache_bytes: int = 0
    encoder_cache_source: str = ""
    # Why an image-text model's encoder cache is not in `encoder_cache_bytes` although vLLM reserves one ("" when
    # it is, or when there is none): the pool then overstates vLLM's.
    encoder_cache_missing: str = ""
    # The rule (kvlab.specs.vllm_defaults.Release.sizing) and which release's source it is read from
    sizing: str = "v1+graphs"
    vllm_note: str = ""
    # The measured rule's terms: memory in use before vLLM's snapshot (charged there, inside the engine cap
    # otherwise), the graph estimate kept free beside the activation peak, and the cache's VMM segments
    context_bytes: int = 0
    context_source: str = "none counted"
    cuda_graph_estimate_bytes: int = 0
    kv_segments: int = 1
    # The same budget with every estimated term at its bound (kvlab.costs.budget.FLOOR); None: this is the floor
    floor: MemoryBudget | None = None

    def __post_init__(self) -> None:
        if self.sizing not in ("v0", "v1", "v1+graphs", "measured"):
            raise ValueError(f"sizing must be v0, v1, v1+graphs or measured, got {self.sizing!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in (
            "capacity_bytes",
            "runtime_bytes",
            "weight_bytes",
            "activation_bytes",
            "driver_reserved_bytes",
            "sampler_bytes",
            "cuda_graph_bytes",
            "draft_weight_bytes",
            "draft_kv_bytes_per_token",
            "encoder_cache_bytes",
            "speculative_tokens",
            "lookahead_slots",
            "context_bytes",
            "cuda_graph_estimate_bytes",
        ):
            check_count(name, getattr(self, name), 0)
        for name in ("block_size", "kv_bytes_per_token", "kv_segments"):
            check_count(name, getattr(self, name))
        if self.max_model_len is not None:
            check_count("max_model_len", self.max_model_len)
        if self.draft_kv_bytes_per_token >= self.kv_bytes_per_token:
            raise ValueError(
                f"draft_kv_bytes_per_token ({self.draft_kv_bytes_per_token}) is part of kv_bytes_per_token "
                f"({self.kv_bytes_per_token}) and must be smaller"
            )
        if self.driver_reserved_bytes > self.capacity_bytes:
            raise ValueError(
                f"driver_reserved_bytes ({self.driver_reserved_bytes}) exceeds the capacity ({self.capacity_bytes})"
            )

    @property
    def cuda_total_bytes(self) -> int:
        """The total CUDA reports, which vLLM multiplies by `gpu_memory_utilization`."""
        return self.capacity_bytes - self.driver_reserved_bytes

    @property
    def requested_bytes(self) -> int:
        """vLLM's requested memory: ceil(CUDA's total × gpu_memory_utilization) (`request_memory`)."""
        return math.ceil(self.cuda_total_bytes * self.gpu_memory_utilization)

    @property
    def engine_cap_bytes(self) -> int:
        """Bytes the engine leaves unused: CUDA's total × (1 - gpu_memory_utilization), rounded down."""
        return self.cuda_total_bytes - self.requested_bytes

    @property
    def peak_bytes(self) -> int:
        """The profile run's activation peak: the forward's or the sampler's, whichever is larger, with the
        encoder cache both run beside."""
        return self.encoder_cache_bytes + max(self.activation_bytes, self.sampler_bytes)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def transient_bytes(self) -> int:
        """The measured rule's transient kept free: the profiled peak plus the graph estimate
        (`reserved_headroom_bytes`, vllm/v1/worker/gpu_worker.py of 0.34.0); 0 under an estimate rule."""
        return self.peak_bytes + self.cuda_graph_estimate_bytes if self.sizing == "measured" else 0

    @property
    def margin_bytes(self) -> int:
        """The measured rule's margin beyond the transient: max(1 GiB, 0.75 × transient)."""
        if self.sizing != "measured":
            return 0
        return max(KV_CACHE_MARGIN_FLOOR_BYTES, int(self.transient_bytes * KV_CACHE_MARGIN_FRACTION))

    @property
    def used_bytes(self) -> int:
        """What vLLM keeps outside the cache after start-up: non-torch memory, weights and (measured) graphs."""
        graphs = self.cuda_graph_bytes if self.sizing == "measured" else 0
        return self.runtime_bytes + self.weight_bytes + self.draft_weight_bytes + graphs

    @property
    def reservation_bytes(self) -> int:
        """The estimate rule's KV memory, vLLM's "Available KV cache memory"; under the measured rule only the
        address space reserved, which caps the measured pool."""
        graphs = self.cuda_graph_estimate_bytes if self.sizing == "measured" else self.cuda_graph_bytes
        return (
            self.requested_bytes
            - self.runtime_bytes
            - self.weight_bytes
            - self.draft_weight_bytes
            - self.peak_bytes
            - graphs
            - (self.context_bytes if self.sizing == "v0" else 0)
        )

    @property
    def utilization_cap_bytes(self) -> int:
        """Measured rule: what a utilisation below 1.0 withholds beyond the device's own limit (0 when the
        device binds first)."""
        if self.sizing != "measured":
            return 0
        device = self.cuda_total_bytes - self.context_bytes - self.used_bytes - self.margin_bytes
        return max(device - (self.requested_bytes - self.used_bytes), 0)

    @property
    def reservation_cap_bytes(self) -> int:
        """Measured rule: what the reserved address space cuts off the measured figure (usually 0)."""
        if self.sizing != "measured":
            return 0
        device = self.cuda_total_bytes - self.context_bytes - self.used_bytes - self.margin_bytes
        measured = device - self.utilization_cap_bytes - self.transient_bytes
        return max(measured - self.reservation_bytes, 0)

    @property
    def kv_headroom_bytes(self) -> int:
        """What the other terms leave for the cache; negative when they alone do not fit."""
        if self.sizing != "measured":
            return self.reservation_bytes
        device = self.cuda_total_bytes - self.context_bytes - self.used_bytes - self.margin_bytes
        return device - self.utilization_cap_bytes - self.transient_bytes - self.reservation_cap_bytes

    def _physical_bytes(self, num_blocks: int) -> int:
        """Bytes a commit of `num_blocks` maps: each VMM segment rounded up to the granule."""
        per_segment = cdiv(num_blocks * self.block_bytes, self.kv_segments)
        return self.kv_segments * cdiv(per_segment, VMM_GRANULE_BYTES) * VMM_GRANULE_BYTES

    @property
    def num_blocks(self) -> int:
        headroom = max(self.kv_headroom_bytes, 0)
        blocks = headroom // self.block_bytes
        if self.sizing == "measured":
            # vLLM's ExtensibleKVCache.blocks_within: the most blocks whose mapped granules fit
            while blocks > 0 and self._physical_bytes(blocks) > headroom:
                blocks -= 1
        return blocks

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the expected KV pool: whole blocks only."""
        return self.num_blocks * self.block_bytes

    @property
    def kv_pool_floor_bytes(self) -> int:
        """The pool with every estimated term at its bound: a lower bound on vLLM's (kvlab.costs.budget.FLOOR)."""
        return self.kv_pool_bytes if self.floor is None else self.floor.kv_pool_bytes

    @property
    def rounding_bytes(self) -> int:
        """Headroom lost to block rounding (less than one block)."""
        return max(self.kv_headroom_bytes, 0) - self.kv_pool_bytes

    @property
    def fits(self) -> bool:
        """Whether the pool holds at least one block."""
        return self.num_blocks >= 1

    @property
    def target_kv_bytes_per_token(self) -> int:
        """The target's own layers' bytes per token (`kv_bytes_per_token` less the drafter's)."""
        return self.kv_bytes_per_token - self.draft_kv_bytes_per_token

    def slots_per_sequence(self, context_len: int) -> int:
        """Token slots one sequence of `context_len` tokens holds, the `lookahead_slots` of speculation included
        (`kvlab.specs.sizing.sequence_slots`)."""
        return sequence_slots(context_len, self.lookahead_slots, self.max_model_len)

    def blocks_per_sequence(self, context_len: int) -> int:
        """Blocks one sequence of `context_len` tokens holds (the last one partly empty), lookahead included."""
        return cdiv(self.slots_per_sequence(context_len), self.block_size)

    def max_sequences(self, context_len: int) -> int:
        """How many sequences of `context_len` tokens the pool holds at once, in whole blocks (a lower bound
        for models with sliding-window layers, whose blocks an engine may free behind the window)."""
        return self.num_blocks // self.blocks_per_sequence(context_len)

    def max_tokens(self) -> int:
        """Token slots in the pool, summed over sequences."""
        return self.num_blocks * self.block_size

    def stack(self) -> list[tuple[str, int, str]]:
        """The terms from the capacity down, as (name, bytes, where the figure comes from); with the pool they
        sum to the capacity. Zero terms are kept, so a rule always shows the same rows."""
        util = self.gpu_memory_utilization
        out = [("driver reserve", self.driver_reserved_bytes, self.driver_reserved_source)]
        measured = self.sizing == "measured"
        if measured or self.sizing == "v0":
            before = "charged by v0, which counts all memory outside PyTorch" if self.sizing == "v0" else ""
            out.append(
                ("context", self.context_bytes, f"{self.context_source}{'; ' if before else ''}{before}")
            )
        if not measured:
            out.append(("engine cap", self.engine_cap_bytes, f"1 - gpu_memory_utilization ({util:g})"))
        out += [
            ("non-torch", self.runtime_bytes, self.runtime_source),
            ("weights", self.weight_bytes, "parameters × bytes"),
        ]
        if self.speculative_tokens:
            out.append(("draft weights", self.draft_weight_bytes, self.draft_weight_source))
        if measured:
            transient = self.transient_bytes
            out += [
                ("CUDA graphs", self.cuda_graph_bytes, self.cuda_graph_source),
                (
                    "margin",
                    self.margin_bytes,
                    f"max(1 GiB, 0.75 × the transient {format_bytes(transient)})",
                ),
                (
                    "utilisation cap",
                    self.utilization_cap_bytes,
                    f"gpu_memory_utilization {util:g} withholds this beyond the device's own limit",
                ),
                (
                    "transient peak",
                    transient - self.encoder_cache_bytes,
                    f"kept free: activations {format_bytes(self.peak_bytes - self.encoder_cache_bytes)} "
                    f"({self._peak_note()}) + graph estimate {format_bytes(self.cuda_graph_estimate_bytes)}",
                ),
            ]
            if self.encoder_cache_bytes:
                out.append(
                    ("encoder cache", self.encoder_cache_bytes, f"kept free too: {self.encoder_cache_source}")
                )
            out.append(
                (
                    "reservation cap",
                    self.reservation_cap_bytes,
                    "the address space reserved from the estimate",
                )
            )
        else:
            out.append(("activations", self.peak_bytes, self._peak_note()))
            out.append(("CUDA graphs", self.cuda_graph_bytes, self.cuda_graph_source))
        return out

    def lines(self, context_len: int | None = None) -> list[str]:
        """The budget, one term a line, each with where its figure comes from (estimate or measured)."""

        def row(label: str, value: int, note: str) -> str:
            return f"  {label:<22}{format_bytes(value):>11}   {note}"

        out = [f"  rule: {self.vllm_note or 'vLLM'} ({_RULES[self.sizing]})"]
        out.append(row("capacity", self.capacity_bytes, "what the driver (NVML, nvidia-smi) reports"))
        always = ("engine cap", "non-torch", "weights", "activations", "transient peak", "margin")
        for name, value, note in self.stack():
            if name == "activations" and self.encoder_cache_bytes:
                out.append(row("- activations", value - self.encoder_cache_bytes, self._peak_note()))
                out.append(row("- encoder cache", self.encoder_cache_bytes, self.encoder_cache_source))
            elif value or name in always:
                out.append(row(f"- {name}", value, note))
        if self.encoder_cache_missing:
            out.append(
                f"  not counted  vLLM's encoder cache: {self.encoder_cache_missing} (the pool is not a lower "
                "bound here; --limit-images 0 budgets a text-only server)"
            )
        if self.kv_headroom_bytes < 0:
            out.append(
                f"  = does NOT fit: the terms above exceed the capacity by {format_bytes(-self.kv_headroom_bytes)}"
            )
            return out
        out += [
            row("- block rounding", self.rounding_bytes, f"whole blocks of {self.block_size} tokens"),
            row(
                "= KV pool (expected)",
                self.kv_pool_bytes,
                f"{self.num_blocks:,} blocks × {format_bytes(self.block_bytes)} = {self.max_tokens():,} tokens; "
                "central estimates",
            ),
        ]
        if self.floor is not None:
            out.append(
                row(
                    "  KV pool floor",
                    self.kv_pool_floor_bytes,
                    f"{self.floor.num_blocks:,} blocks; every estimate at its bound (a lower bound on vLLM's)",
                )
            )
        if self.settings_note:
            out.append(f"  at {self.settings_note}")
        if self.speculative_tokens:
            out += self._speculative_lines()
        if context_len is not None:
            extra = self.slots_per_sequence(context_len) - context_len
            capped = " (capped at max_model_len)" if extra < self.lookahead_slots else ""
            ahead = f" + {extra} speculative slots{capped}" if self.lookahead_slots else ""
            floor = (
                "" if self.floor is None else f"; the floor holds {self.floor.max_sequences(context_len):,}"
            )
            out.append(
                f"  sequences that fit    {self.max_sequences(context_len):>11,}   of {format_tokens(context_len)} "
                f"tokens{ahead} ({self.blocks_per_sequence(context_len)} blocks each), in the expected pool{floor}"
            )
        return out

    def _speculative_lines(self) -> list[str]:
        k, cap = self.speculative_tokens, self.max_model_len
        return [
            f"  KV per token {self.kv_bytes_per_token:>15,} B   target {self.target_kv_bytes_per_token:,} B + "
            f"draft {self.draft_kv_bytes_per_token:,} B ({self.draft_kv_source}; one pool, vLLM's shared KV-cache groups)",
            f"  speculation  K={k}: {self.lookahead_slots} slots per running sequence ahead of its tokens ({k} drafts "
            f"verified + {k} lookahead, vllm/v1/core/sched/scheduler.py)"
            + (f", capped at max_model_len {cap:,}" if cap is not None else ""),
            "  not counted  the drafter's own activation peak and graph captures (the pool is not a lower bound here)",
        ]

    def _peak_note(self) -> str:
        if not self.sampler_bytes:
            return self.activation_source
        forward, sampler = format_bytes(self.activation_bytes), format_bytes(self.sampler_bytes)
        larger = "forward" if self.activation_bytes >= self.sampler_bytes else "sampler"
        return f"the {larger}'s: forward {forward} ({self.activation_source}), sampler {sampler} ({self.sampler_source})"


_RULES = {
    "v0": "v0: the profiled step and all memory outside PyTorch charged, no CUDA graphs",
    "v1": "v1 estimate: the profiled step charged, no CUDA graphs",
    "v1+graphs": "v1 estimate: the profiled step and the CUDA-graph estimate charged",
    "measured": "measured after warmup and graph capture: the extensible KV cache",
}


def charge_encoder_cache(plan: MemoryBudget, images: ImageCost) -> MemoryBudget:
    """`plan` with vLLM's encoder cache for those images charged beside the profile run's peak (its floor too)."""
    floor = None if plan.floor is None else charge_encoder_cache(plan.floor, images)
    return dataclasses.replace(
        plan,
        encoder_cache_bytes=images.encoder_cache_bytes,
        encoder_cache_source=images.encoder_cache_note,
        floor=floor,
    )


def activation_workspace_bytes(
    config: PretrainedConfig | str,
    num_tokens: int = MAX_NUM_BATCHED_TOKENS,
    num_seqs: int = MAX_NUM_SEQS,
    dtype: str = "bf16",
    tp: int = 1,
) -> int:
    """Estimated peak activation bytes of one forward over `num_tokens` tokens with fused attention.

    With `tp` tensor-parallel ranks, one rank's: the MLP width and the q/k/v heads are split `tp` ways (k/v
    never below one head), the residual stream is whole on every rank.

    Per token, the largest live set is the MLP's: the residual stream and its normed copy (2 × hidden), and
    the gate and up projections, the activated gate and the product (4 × MLP width, as an unfused forward holds
    them; an MoE token runs `experts_per_token` experts); or the attention's: residual, normed copy, q, k, v and
    the attention output. Both hold the rotary cos/sin tables (2 × head_dim) and an int64 position id. Attention
    itself is assumed fused (SDPA or FlashAttention: no context × context scores; eager attention, which
    transformers uses for Gemma 2's soft-capping, holds the scores too and needs more). Logits are fp32 for the `num_seqs` sampled rows.
    Engines that fuse the gated MLP hold less, so the estimate errs on the side of a smaller KV pool; an engine
    with the model at hand measures the peak instead (`kvlab.engine`). The tests check it against a measured
    forward of real transformers models.
    """
    check_count("num_tokens", num_tokens)
    check_count("num_seqs", num_seqs)
    model = shape(config)
    spec, hidden, width, experts = model.spec, model.hidden_size, model.mlp_width, model.experts_per_token
    if width is None:
        raise ValueError(f"{spec.name}: the config sets no intermediate_size to size the MLP's activations")
    check_count("tp", tp)
    mlp = 2 * hidden + 4 * cdiv(width * experts, tp)
    q = spec.num_attention_heads * spec.head_dim // tp
    kv = max(
        layer.expanded_elements_per_token * max(1, layer.cache_heads // tp) // max(1, layer.cache_heads)
        for layer in spec.layers
    )
    attention = 3 * hidden + q + kv
    per_token = (max(mlp, attention) + 2 * spec.head_dim) * dtype_bytes(dtype) + 8  # + int64 position id
    logits = min(num_seqs, num_tokens) * model.vocab_size * 4
    return num_tokens * per_token + logits


def memory_budget(
    config: PretrainedConfig | str,
    gpu: str | hardware.Accelerator,
    *,
    kv_dtype: str = "bf16",
    weight_dtype: str | int = "bf16",
    gpu_memory_utilization: float | None = None,
    runtime_bytes: int | None = None,
    activation_bytes: int | None = None,
    driver_reserved_bytes: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    block_size: int | None = None,
    tp: int = 1,
    pp: int = 1,
    usage_context: str = vllm_defaults.USAGE_CONTEXT,
    enable_chunked_prefill: bool | None = None,
    max_model_len: int | None = None,
    enforce_eager: bool = False,
    estimate_cuda_graphs: bool | None = None,
    speculative: int = 0,
    draft: PretrainedConfig | str | None = None,
    draft_layers: int = 0,
    limit_images: int | None = None,
    vllm_version: str | None = None,
    extensible_kv_cache: bool | None = None,
    context_bytes: int | None = None,
    estimates: Estimates = CENTRAL,
    with_floor: bool = True,
) -> MemoryBudget:
    """The budget of serving `config` on `gpu` (a spec-table name or entry) as `vllm_version` sizes it (a release
    or "v0"/"v1", `kvlab.specs.vllm_defaults.resolve`; the current release when None), with its `floor`.

    Settings left None are that release's defaults: the utilisation (0.34: 1.0 with the extensible cache, 0.92
    without), the block size, chunked prefill (v0: on only above 32k tokens), the CUDA-graph charge and
    `extensible_kv_cache` (0.34's switch; False is its estimate-rule fallback). `estimates` are the terms of the
    expected pool (`CENTRAL`); the floor always takes `FLOOR`. `context_bytes` replaces the estimate of memory in
    use before vLLM's snapshot (charged by the measured rule and v0). `with_floor=False` skips the floor.

    `max_num_batched_tokens` and `max_num_seqs` left None are vLLM's defaults for this GPU and `usage_context`
    ("serve" or "llm", `kvlab.specs.vllm_defaults.batch_defaults`); with `enable_chunked_prefill=False` the token
    budget rises to `max_model_len` (the model's limit when None). Pass `runtime_bytes` (non-torch memory),
    `activation_bytes` (the profile run's peak) or `driver_reserved_bytes` measured on a GPU to replace the
    estimates. With `tp` tensor-parallel ranks and `pp` pipeline stages it is the budget of ONE GPU of the
    largest stage: its weights (`kvlab.specs.sizing.weight_bytes_per_gpu`), its KV bytes per token
    (`kvlab.specs.sizing.kv_bytes_per_token(..., tp, pp)`, heads copied past the KV-head count) and an activation
    estimate whose head and MLP widths are split `tp` ways. The block and sequence counts are then the whole
    deployment's: every GPU of a stage holds the same blocks. `enforce_eager` captures no CUDA graphs;
    `estimate_cuda_graphs=False` is `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0` (the default before 0.20, and
    v0): the graphs are captured but not charged to the pool.

    `speculative=K` with a `draft` model (a registry name, id or config) or `draft_layers` (an EAGLE-style head
    of that many layers of the target's attention shape): the drafter's weights and cache layers and the 2K
    slots per running sequence enter the budget (see the module docstring); `max_model_len` (the model's limit
    when None) caps a sequence's slots. `speculative=0` with no drafter is the budget without speculation.

    An image-text model's encoder cache (`kvlab.specs.images.encoder_cache`) is charged beside the profile run's
    peak, as vLLM reserves it, unless `limit_images=0` (vLLM's `--limit-mm-per-prompt '{"image": 0}'`, a
    text-only server). Where kvlab has no image rule for the model, the budget says so in a "not counted" line.
    """
    chosen = vllm_defaults.resolve(vllm_version)
    kwargs = dict(
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        runtime_bytes=runtime_bytes,
        activation_bytes=activation_bytes,
        driver_reserved_bytes=driver_reserved_bytes,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        tp=tp,
        pp=pp,
        usage_context=usage_context,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        estimate_cuda_graphs=estimate_cuda_graphs,
        speculative=speculative,
        draft=draft,
        draft_layers=draft_layers,
        limit_images=limit_images,
        extensible_kv_cache=extensible_kv_cache,
        context_bytes=context_bytes,
    )
    expected = _budget(config, gpu, chosen, estimates, **kwargs)  # type: ignore[arg-type]
    if not with_floor:
        return expected
    floor = _budget(config, gpu, chosen, FLOOR, **kwargs)  # type: ignore[arg-type]
    return dataclasses.replace(expected, floor=floor)


def _budget(
    config: PretrainedConfig | str,
    gpu: str | hardware.Accelerator,
    chosen: vllm_defaults.ResolvedRelease,
    estimates: Estimates,
    *,
    kv_dtype: str,
    weight_dtype: str | int,
    gpu_memory_utilization: float | None,
    runtime_bytes: int | None,
    activation_bytes: int | None,
    driver_reserved_bytes: int | None,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
    block_size: int | None,
    tp: int,
    pp: int,
    usage_context: str,
    enable_chunked_prefill: bool | None,
    max_model_len: int | None,
    enforce_eager: bool,
    estimate_cuda_graphs: bool | None,
    speculative: int,
    draft: PretrainedConfig | str | None,
    draft_layers: int,
    limit_images: int | None,
    extensible_kv_cache: bool | None,
    context_bytes: int | None,
) -> MemoryBudget:
    """One budget of `memory_budget`, every estimated term from `estimates`."""
    from kvlab.specs import arch, images
    from kvlab.specs.sizing import (
        draft_kv_bytes_per_token,
        draft_weight_bytes_per_gpu,
        kv_bytes_per_token,
        refuse_state,
        speculation,
        weight_bytes_per_gpu,
    )

    spec = hardware.get(gpu) if isinstance(gpu, str) else gpu
    if limit_images is not None:
        check_count("limit_images", limit_images, 0)
    # a registry name carries its image processor's pixel limits; a config does not
    named = config if isinstance(config, str) and config in arch.registry() else None
    config = prepare(config)
    # vLLM gives Mamba and linear-attention state its own page size beside the KV blocks; this budget has KV
    # blocks only, so a state model's sequence count would be silently wrong.
    refuse_state(shape(config).spec, "kvlab's vLLM memory budget")
    spec_decode = speculation(config, speculative, draft, draft_layers, tp, pp)
    rule = chosen.release
    sizing = _sizing(chosen, extensible_kv_cache)
    if enable_chunked_prefill is None:
        enable_chunked_prefill = rule.chunked_prefill(max_model_len or shape(config).max_context)
    if estimate_cuda_graphs is None:
        estimate_cuda_graphs = rule.estimate_cuda_graphs
    if gpu_memory_utilization is None:
        extensible = sizing == "measured"
        gpu_memory_utilization = (
            rule.gpu_memory_utilization if extensible else rule.estimate_gpu_memory_utilization
        )
    block_size = rule.block_size if block_size is None else block_size
    if max_model_len is None and not enable_chunked_prefill:
        max_model_len = shape(config).max_context
    batch = vllm_defaults.batch_defaults(
        spec.memory_bytes,
        spec.name,
        usage_context,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=max_model_len,
        release=rule,
    )
    tokens = batch.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    seqs = batch.max_num_seqs if max_num_seqs is None else max_num_seqs
    check_count("max_num_batched_tokens", tokens)
    check_count("max_num_seqs", seqs)
    rows = min(seqs, tokens)
    act_dtype = weight_dtype if isinstance(weight_dtype, str) else "bf16"  # quantized weights compute in bf16
    where = "chosen" if max_num_batched_tokens is None else "given"
    if activation_bytes is None:
        forward = forward_peak_bytes(config, tokens, act_dtype, tp=tp, estimates=estimates)
        sampler = sampler_peak_bytes(config, rows, estimates, _version_of(chosen))
        forward_source = f"estimate, {tokens:,} batched tokens"
        sampler_source = f"estimate, {rows:,} rows of logits"
    else:
        forward, sampler = activation_bytes, 0
        forward_source, sampler_source = "measured (profiled forward and sampler)", "none counted"
    captured = (
        0 if enforce_eager else cuda_graph_bytes(config, seqs, tokens, act_dtype, tp=tp, estimates=estimates)
    )
    estimated = captured if estimate_cuda_graphs else 0
    # the estimate rules charge the estimate; the measured one keeps the captured pool and the estimate free
    graphs, graph_estimate = (captured, estimated) if sizing == "measured" else (estimated, 0)
    graph_source = (
        f"estimate, {len(cuda_graph_sizes(seqs, tokens))} capture sizes (measured: vLLM's log)"
        if sizing != "measured"
        else f"captured pool, estimate over {len(cuda_graph_sizes(seqs, tokens))} sizes (vLLM's 'CUDA graph pool memory')"
    )
    target_kv = kv_bytes_per_token(config, kv_dtype, tp=tp, pp=pp)
    plain = MemoryBudget(
        capacity_bytes=spec.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        runtime_bytes=estimates.non_torch(tp, spec.nvls) if runtime_bytes is None else runtime_bytes,
        weight_bytes=weight_bytes_per_gpu(config, weight_dtype, tp=tp, pp=pp),
        activation_bytes=forward,
        block_size=block_size,
        kv_bytes_per_token=target_kv,
        runtime_source=(
            f"estimate at TP={tp}{'' if tp == 1 else (', NVLS' if spec.nvls else ', no NVLS')} "
            "(kvlab.costs.budget.non_torch_bytes)"
            if runtime_bytes is None
            else "measured (vLLM's non_torch_memory)"
        ),
        activation_source=forward_source,
        driver_reserved_bytes=estimates.driver_reserved_bytes
        if driver_reserved_bytes is None
        else driver_reserved_bytes,
        driver_reserved_source=(
            "estimate: NVML's total less CUDA's (measured: torch.cuda.mem_get_info)"
            if driver_reserved_bytes is None
            else "measured: NVML's total less CUDA's"
        ),
        sampler_bytes=sampler,
        sampler_source=sampler_source,
        cuda_graph_bytes=graphs,
        cuda_graph_source=graph_source,
        cuda_graph_estimate_bytes=graph_estimate,
        sizing=sizing,
        vllm_note=chosen.note + ("" if sizing == rule.sizing else ", extensible KV cache off"),
        context_bytes=estimates.context(tp) if context_bytes is None else context_bytes,
        context_source=(
            f"estimate at TP={tp}: CUDA context, cuBLAS{', NCCL' if tp > 1 else ''} before vLLM's snapshot"
            if context_bytes is None
            else "measured: CUDA's total less its free memory at start-up"
        ),
        kv_segments=max(cdiv(len(shape(config).spec.layers), pp), 1),
        settings_note=(
            f"max_num_batched_tokens {tokens:,} ({where}), max_num_seqs {seqs:,}"
            + (
                ""
                if max_num_batched_tokens is not None and max_num_seqs is not None
                else f": {batch.describe()}"
            )
        ),
    )
    if limit_images != 0:
        try:
            encoder = images.encoder_cache(named or config, tokens, act_dtype)
        except ValueError as err:
            plain = dataclasses.replace(plain, encoder_cache_missing=str(err))
        else:
            if encoder is not None:
                plain = dataclasses.replace(
                    plain, encoder_cache_bytes=encoder.nbytes, encoder_cache_source=encoder.note
                )
    if spec_decode is None:
        return plain
    head = spec_decode.draft is None
    draft_kv = draft_kv_bytes_per_token(config, spec_decode, kv_dtype, tp=tp)
    return dataclasses.replace(
        plain,
        kv_bytes_per_token=target_kv + draft_kv,
        draft_weight_bytes=draft_weight_bytes_per_gpu(config, spec_decode, weight_dtype, tp=tp),
        draft_weight_source=(
            f"estimate: {spec_decode.draft_layers} decoder layer(s) of the target's shape + fc, embedding and "
            "lm_head shared (kvlab.specs.sizing.draft_weight_bytes_per_gpu)"
            if head
            else f"{spec_decode.draft_name}: parameters × bytes, at the target's tp"
        ),
        draft_kv_bytes_per_token=draft_kv,
        draft_kv_source=(
            f"estimate: {spec_decode.draft_layers} layer(s) of the target's attention shape"
            if head
            else f"{spec_decode.draft_name}'s layers, exact"
        ),
        speculative_tokens=spec_decode.num_speculative_tokens,
        lookahead_slots=spec_decode.lookahead_slots,
        max_model_len=max_model_len if max_model_len is not None else shape(config).max_context,
    )


def _version_of(chosen: vllm_defaults.ResolvedRelease) -> tuple[int, ...]:
    """The release a budget was asked for: its number, or its family's rule's."""
    try:
        return vllm_defaults.version_tuple(chosen.asked)
    except ValueError:
        return vllm_defaults.version_tuple(chosen.release.version)


def _sizing(chosen: vllm_defaults.ResolvedRelease, extensible_kv_cache: bool | None) -> str:
    """The rule a budget applies: the release's, or 0.34's estimate fallback with the extensible cache off."""
    rule = chosen.release
    if extensible_kv_cache is None or extensible_kv_cache == rule.extensible_kv_cache:
        return rule.sizing
    if extensible_kv_cache:
        raise ValueError(f"{chosen.note} has no extensible KV cache (vLLM 0.34.0 and later)")
    return "v1+graphs"


@dataclass(frozen=True)
class BudgetSettings:
    """The engine settings a memory budget depends on, vLLM's names and defaults (`kvlab.specs.vllm_defaults`): what
    `kvlab size --gpu`, `kvlab.planning.plan` and `kvlab.planning.diagnose` size the pool with, each keyword of `memory_budget`
    once. `max_num_batched_tokens` and `max_num_seqs` left None are vLLM's choice for the GPU (`resolved`).

    `vllm_version` (a release or "v0"/"v1") picks the rule; the utilisation, block size, CUDA-graph charge,
    extensible cache and (v1, or v0 with `max_model_len`) chunked prefill left None become that release's defaults
    on construction, so `dataclasses.replace(s, vllm_version=...)` keeps the first release's: build anew."""

    kv_dtype: str = "bf16"
    weight_dtype: str | int = "bf16"
    gpu_memory_utilization: float = None  # type: ignore[assignment]  # None: the release's default
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int = None  # type: ignore[assignment]  # None: the release's default
    tp: int = 1
    pp: int = 1
    usage_context: str = vllm_defaults.USAGE_CONTEXT
    enable_chunked_prefill: bool | None = None  # None: the release's rule (v0: on only above 32k tokens)
    max_model_len: int | None = None
    enforce_eager: bool = False
    estimate_cuda_graphs: bool = None  # type: ignore[assignment]  # None: the release's default
    vllm_version: str = vllm_defaults.VLLM_VERSION
    extensible_kv_cache: bool = None  # type: ignore[assignment]  # None: the release's default (0.34: on)
    speculative: int = 0  # K speculative tokens; 0 is off
    draft: str | None = None  # the draft model (vLLM's method "draft_model")
    draft_layers: int = 0  # or an EAGLE-style head of this many layers of the target's shape
    # images a prompt may carry (vLLM's --limit-mm-per-prompt); 0 is a text-only server, no encoder cache
    limit_images: int | None = None

    def __post_init__(self) -> None:
        chosen = vllm_defaults.resolve(self.vllm_version)
        rule = chosen.release
        extensible = _sizing(chosen, self.extensible_kv_cache) == "measured"
        resolved = {
            "extensible_kv_cache": extensible,
            "block_size": rule.block_size,
            "estimate_cuda_graphs": rule.estimate_cuda_graphs,
            "gpu_memory_utilization": rule.gpu_memory_utilization
            if extensible
            else rule.estimate_gpu_memory_utilization,
        }
        if rule.engine == "v1" or self.max_model_len is not None:
            resolved["enable_chunked_prefill"] = rule.chunked_prefill(self.max_model_len)
        for name, value in resolved.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("block_size", "tp", "pp"):
            check_count(name, getattr(self, name))
        for name in ("speculative", "draft_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name))
        if self.limit_images is not None:
            check_count("limit_images", self.limit_images, 0)
        if (
            not isinstance(self.gpu_memory_utilization, int | float)
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(DTYPES)}, got {self.kv_dtype!r}")
        if self.weight_dtype not in DTYPES and not isinstance(self.weight_dtype, int):
            raise ValueError(
                f"weight_dtype must be one of {', '.join(DTYPES)} or a bit count, got {self.weight_dtype!r}"
            )
        if self.usage_context not in vllm_defaults.USAGE_CONTEXTS:
            raise ValueError(
                f"usage_context must be one of {', '.join(vllm_defaults.USAGE_CONTEXTS)}, got {self.usage_context!r}"
            )

    def batch_limits(
        self, gpu: str | hardware.Accelerator, config: PretrainedConfig | str | None = None
    ) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs) at these settings on `gpu`: the given ones, else vLLM's
        choice (the model's `max_model_len` is needed, through `config`, when chunked prefill is off)."""
        spec = hardware.get(gpu) if isinstance(gpu, str) else gpu
        rule = vllm_defaults.resolve(self.vllm_version).release
        max_model_len = self.max_model_len
        if max_model_len is None and config is not None:
            max_model_len = shape(config).max_context
        chunked = self.enable_chunked_prefill
        if chunked is None:
            chunked = rule.chunked_prefill(max_model_len)
        if not chunked and max_model_len is None:
            raise ValueError(
                "with chunked prefill off, vLLM's token budget depends on max_model_len: pass it"
            )
        batch = vllm_defaults.batch_defaults(
            spec.memory_bytes,
            spec.name,
            self.usage_context,
            enable_chunked_prefill=chunked,
            max_model_len=max_model_len if not chunked else self.max_model_len,
            release=rule,
        )
        return (
            self.max_num_batched_tokens or batch.max_num_batched_tokens,
            self.max_num_seqs or batch.max_num_seqs,
        )

    def memory_budget(self, config: PretrainedConfig | str, gpu: str | hardware.Accelerator) -> MemoryBudget:
        """`memory_budget` of `config` on `gpu` at these settings."""
        return memory_budget(config, gpu, **dataclasses.asdict(self))
