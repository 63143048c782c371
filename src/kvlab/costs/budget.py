"""The memory budget: what is left for KV blocks once everything else has taken its share of the GPU.

Term by term, the way vLLM 0.33.0 sizes its pool at start-up (read from the 0.33.0 wheel's source):
`vllm/v1/worker/gpu_worker.py` `Worker.init_device` takes a memory snapshot once CUDA, NCCL and the cuBLAS
handles are up, and `request_memory` (`vllm/v1/worker/utils.py`) asks for `ceil(total × gpu_memory_utilization)`
of the CUDA-visible total; `Worker.determine_available_memory` runs `memory_profiling`
(`vllm/utils/mem_utils.py`) around `GPUModelRunner.profile_run` and returns

    requested - (weights + non-torch increase + persistent buffers) - transient peak - CUDA-graph estimate.

1. **capacity**: the total NVML (`nvidia-smi`) reports, as `kvlab.specs.hardware` stores it;
2. **driver reserve**: CUDA's own total (`cudaMemGetInfo`, what vLLM multiplies) is smaller by a few hundred
   MiB. An estimate (`DRIVER_RESERVED_BYTES`), measured on a GPU as `torch.cuda.mem_get_info()[1]`;
3. **engine cap**: `1 - gpu_memory_utilization` of CUDA's total stays unused. The CUDA context, NCCL's
   buffers and cuBLAS's handles exist before vLLM's snapshot, so they live inside this headroom and are not
   subtracted again (`kvlab.measure.cuda_context_bytes` measures them on a GPU);
4. **non-torch memory**: what grows outside PyTorch during the profile run (attention workspaces, the
   communication buffers `_dummy_run(is_profile=True)` pre-allocates). An estimate per TP size
   (`non_torch_bytes`): much larger at TP >= 2;
5. **weights**: parameters × bytes (`kvlab.specs.sizing.weight_bytes_per_gpu`), vLLM's "Model loading took";
6. **activation peak**: `profile_run` runs `_dummy_run(max_num_batched_tokens)` and then `_dummy_sampler_run`
   on `min(max_num_seqs, max_num_batched_tokens)` rows of logits; the allocator's peak is the larger of the
   two, since the forward's tensors are freed first. Both are estimates (`forward_peak_bytes`,
   `sampler_peak_bytes`); an engine with the model at hand measures the peak (`kvlab.engine` does). With
   chunked prefill off vLLM raises `max_num_batched_tokens` to `max_model_len`, so one whole prompt is profiled;
7. **CUDA graphs**: `GPUModelRunner.profile_cudagraph_memory` captures two graphs per mode and extrapolates;
   0.33 subtracts that estimate (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`, the default since 0.21).
   kvlab's estimate: `cuda_graph_bytes`; none with `enforce_eager`;
8. **block rounding**: the pool holds whole blocks of `block_size` tokens, and a sequence holds whole blocks.

**Speculative decoding** (`speculative=K` with a `draft` model or `draft_layers`, an EAGLE-style head; the vLLM
source read is cited in `kvlab.specs.sizing`'s speculative section): the drafter's weights are loaded before the
profile run and subtracted beside the target's (`kvlab.specs.sizing.draft_weight_bytes_per_gpu`; an estimate for
a head); its attention layers share the target's KV-cache groups, so a block holds target + draft layers
(`kvlab.specs.sizing.draft_kv_bytes_per_token`) and the pool has fewer blocks; and each running sequence holds
2K slots more (K drafts under verification, K lookahead: `kvlab.specs.sizing.speculative_slots`), capped at
`max_model_len`. The drafter's own activation peak and graph captures are not counted, so with speculation the
pool is no longer the lower bound described below.

**When the pool is a bound.** `kv_pool_bytes` is a lower bound on vLLM 0.33's "Available KV cache memory" at
the same settings when each estimated term (driver reserve, non-torch memory, activation peak, CUDA graphs) is
at or above what vLLM measures and the weights are vLLM's. The estimates are chosen above every published
measurement kvlab has (`tests/data/vllm_logs`); `tests/test_budget_vs_logs.py` checks the pool against them.

`MemoryBudget` is the one place a KV budget is computed: `kvlab size --gpu`, the chapters' "N sequences fit"
figures and the engine's pool all come from it; vLLM's defaults come from `kvlab.specs.vllm_defaults`. Chapters:
*Active tokens, not batch size* (book/05_active_tokens), *Long context* (book/06_long_context).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.checks import check_count
from kvlab.specs import hardware, vllm_defaults
from kvlab.specs.shape import prepare, shape
from kvlab.units import MiB, dtype_bytes, format_bytes, format_tokens

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

# NVML's total less CUDA's: 430 MiB on an RTX 3090 (23.58 GiB printed by vLLM, tests/data/vllm_logs), 479 MiB
# on an H100 80GB (79.18 GiB, llm-d/llm-d-benchmark), 494 MiB on an RTX PRO 4500 (vllm-project/vllm#51590).
DRIVER_RESERVED_BYTES = 512 * MiB
# Memory outside PyTorch that vLLM's profile run adds: 0.05-0.35 GiB measured at TP=1, about 2.1 GiB per GPU at
# TP >= 2 (NCCL and custom all-reduce buffers), in the logs of tests/data/vllm_logs and kvlab issue 21.
NON_TORCH_BYTES_TP1 = 512 * MiB
NON_TORCH_BYTES_TP = 2304 * MiB
# The sampler's dummy batch, bytes per logit alive at its peak in 0.33 (vllm/v1/sample/sampler.py and
# ops/topk_topp_sampler.py forward_native, Triton top-k/top-p): the bf16 logits (2), their fp32 copy (4), the
# probabilities (4) and the exponential noise (4), rounded up for kernel scratch. The PyTorch path, taken without
# Triton (and by older versions), sorts: values (4) and int64 indices (8) more. A published v1 log measured a
# 4.76 GiB peak for Llama-3.1-8B at 1,024 rows of its 128,256-token vocabulary, 39 B a logit
# (llm-d/llm-d-benchmark, config_explorer/empirical-vllm-memory-results.md): kvlab charges 40 so the pool stays a
# lower bound there too.
SAMPLER_BYTES_PER_LOGIT = 40
# One captured CUDA graph beyond the first: about 24 MiB for a FULL graph (vllm-project/vllm#50780), 23 MiB
# averaged over 16 PIECEWISE graphs (gpustack/runner#251: 0.36 GiB).
CUDA_GRAPH_BYTES = 24 * MiB


def non_torch_bytes(tp: int = 1) -> int:
    """Estimated memory outside PyTorch that vLLM charges per GPU at `tp` tensor-parallel ranks."""
    return NON_TORCH_BYTES_TP1 if check_count("tp", tp) == 1 else NON_TORCH_BYTES_TP


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
) -> int:
    """Estimated CUDA-graph memory as vLLM 0.33 subtracts it (`GPUModelRunner.profile_cudagraph_memory`).

    vLLM's default mode, FULL_AND_PIECEWISE, captures a PIECEWISE graph for every size of `cuda_graph_sizes`
    and a FULL graph for every decode batch up to `max_num_seqs`; per mode it counts its first capture whole
    and the second one once per further graph, then overlays the two modes' first captures (max). kvlab takes
    the first capture as the forward peak at the largest size and `CUDA_GRAPH_BYTES` per further graph."""
    sizes = cuda_graph_sizes(max_num_seqs, max_num_batched_tokens)
    decode = [n for n in sizes if n <= max_num_seqs]
    first = forward_peak_bytes(config, sizes[-1], dtype, tp=tp)
    return first + CUDA_GRAPH_BYTES * (len(sizes) - 1 + max(len(decode) - 1, 0))


def sampler_peak_bytes(config: PretrainedConfig | str, num_seqs: int) -> int:
    """Estimated peak of vLLM's `_dummy_sampler_run`: `num_seqs` rows of logits over the whole vocabulary
    (every TP rank gathers them), `SAMPLER_BYTES_PER_LOGIT` bytes each."""
    return check_count("num_seqs", num_seqs) * shape(config).vocab_size * SAMPLER_BYTES_PER_LOGIT


def forward_peak_bytes(
    config: PretrainedConfig | str, num_tokens: int, dtype: str = "bf16", tp: int = 1
) -> int:
    """Estimated activation peak of vLLM's dummy forward over `num_tokens` tokens: `activation_workspace_bytes`
    with one sampled row (the logits belong to the sampler's run)."""
    return activation_workspace_bytes(config, num_tokens, 1, dtype, tp=tp)


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

    def __post_init__(self) -> None:
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
        ):
            check_count(name, getattr(self, name), 0)
        for name in ("block_size", "kv_bytes_per_token"):
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
    def kv_headroom_bytes(self) -> int:
        """What the other terms leave for the cache; negative when they alone do not fit."""
        return (
            self.requested_bytes
            - self.runtime_bytes
            - self.weight_bytes
            - self.draft_weight_bytes
            - self.peak_bytes
            - self.cuda_graph_bytes
        )

    @property
    def num_blocks(self) -> int:
        return max(self.kv_headroom_bytes, 0) // self.block_bytes

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the KV pool: whole blocks only."""
        return self.num_blocks * self.block_bytes

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
        """Token slots one sequence of `context_len` tokens holds: its tokens, plus under speculation the
        `lookahead_slots` vLLM allocates ahead, never past `max_model_len` (`KVCacheManager.allocate_slots`)."""
        slots = check_count("context_len", context_len)
        if self.lookahead_slots:
            slots += self.lookahead_slots
            if self.max_model_len is not None:
                slots = min(slots, max(context_len, self.max_model_len))
        return slots

    def blocks_per_sequence(self, context_len: int) -> int:
        """Blocks one sequence of `context_len` tokens holds (the last one partly empty), lookahead included."""
        return -(-self.slots_per_sequence(context_len) // self.block_size)

    def max_sequences(self, context_len: int) -> int:
        """How many sequences of `context_len` tokens the pool holds at once, in whole blocks (a lower bound
        for models with sliding-window layers, whose blocks an engine may free behind the window)."""
        return self.num_blocks // self.blocks_per_sequence(context_len)

    def max_tokens(self) -> int:
        """Token slots in the pool, summed over sequences."""
        return self.num_blocks * self.block_size

    def lines(self, context_len: int | None = None) -> list[str]:
        """The budget, one term a line, each with where its figure comes from (estimate or measured)."""

        def row(label: str, value: int, note: str) -> str:
            return f"  {label:<22}{format_bytes(value):>11}   {note}"

        util = self.gpu_memory_utilization
        default = vllm_defaults.GPU_MEMORY_UTILIZATION
        out = [row("capacity", self.capacity_bytes, "what the driver (NVML, nvidia-smi) reports")]
        if self.driver_reserved_bytes:
            out.append(row("- driver reserve", self.driver_reserved_bytes, self.driver_reserved_source))
        out += [
            row(
                "- engine cap",
                self.engine_cap_bytes,
                f"1 - gpu_memory_utilization ({util:g}; vLLM {vllm_defaults.VLLM_VERSION}'s default is "
                f"{default:g}); holds the CUDA context",
            ),
            row("- non-torch memory", self.runtime_bytes, self.runtime_source),
            row("- weights", self.weight_bytes, "parameters × bytes"),
        ]
        if self.speculative_tokens:
            out.append(row("- draft weights", self.draft_weight_bytes, self.draft_weight_source))
        out += [
            row("- activations", self.peak_bytes - self.encoder_cache_bytes, self._peak_note()),
        ]
        if self.encoder_cache_bytes:
            out.append(row("- encoder cache", self.encoder_cache_bytes, self.encoder_cache_source))
        if self.encoder_cache_missing:
            out.append(
                f"  not counted  vLLM's encoder cache: {self.encoder_cache_missing} (the pool is not a lower "
                "bound here; --limit-images 0 budgets a text-only server)"
            )
        if self.cuda_graph_bytes:
            out.append(row("- CUDA graphs", self.cuda_graph_bytes, self.cuda_graph_source))
        if self.kv_headroom_bytes < 0:
            out.append(
                f"  = does NOT fit: the terms above exceed the capacity by {format_bytes(-self.kv_headroom_bytes)}"
            )
            return out
        out += [
            row("- block rounding", self.rounding_bytes, f"whole blocks of {self.block_size} tokens"),
            row(
                "= KV pool",
                self.kv_pool_bytes,
                f"{self.num_blocks:,} blocks × {format_bytes(self.block_bytes)} = {self.max_tokens():,} tokens",
            ),
        ]
        if self.settings_note:
            out.append(f"  at {self.settings_note}")
        if self.speculative_tokens:
            out += self._speculative_lines()
        if context_len is not None:
            extra = self.slots_per_sequence(context_len) - context_len
            capped = " (capped at max_model_len)" if extra < self.lookahead_slots else ""
            ahead = f" + {extra} speculative slots{capped}" if self.lookahead_slots else ""
            out.append(
                f"  sequences that fit    {self.max_sequences(context_len):>11,}   of {format_tokens(context_len)} "
                f"tokens{ahead} ({self.blocks_per_sequence(context_len)} blocks each)"
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


def charge_encoder_cache(plan: MemoryBudget, images: ImageCost) -> MemoryBudget:
    """`plan` with vLLM's encoder cache for those images charged beside the profile run's peak."""
    return dataclasses.replace(
        plan, encoder_cache_bytes=images.encoder_cache_bytes, encoder_cache_source=images.encoder_cache_note
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
    mlp = 2 * hidden + 4 * -(-width * experts // tp)
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
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    runtime_bytes: int | None = None,
    activation_bytes: int | None = None,
    driver_reserved_bytes: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    block_size: int = BLOCK_SIZE,
    tp: int = 1,
    pp: int = 1,
    usage_context: str = vllm_defaults.USAGE_CONTEXT,
    enable_chunked_prefill: bool = vllm_defaults.ENABLE_CHUNKED_PREFILL,
    max_model_len: int | None = None,
    enforce_eager: bool = False,
    estimate_cuda_graphs: bool = vllm_defaults.ESTIMATE_CUDA_GRAPHS,
    speculative: int = 0,
    draft: PretrainedConfig | str | None = None,
    draft_layers: int = 0,
    limit_images: int | None = None,
) -> MemoryBudget:
    """The budget of serving `config` on `gpu` (a spec-table name or entry) as vLLM 0.33.0 sizes it.

    `max_num_batched_tokens` and `max_num_seqs` left None are vLLM's defaults for this GPU and `usage_context`
    ("serve" or "llm", `kvlab.specs.vllm_defaults.batch_defaults`); with `enable_chunked_prefill=False` the token
    budget rises to `max_model_len` (the model's limit when None). Pass `runtime_bytes` (non-torch memory),
    `activation_bytes` (the profile run's peak) or `driver_reserved_bytes` measured on a GPU to replace the
    estimates. With `tp` tensor-parallel ranks and `pp` pipeline stages it is the budget of ONE GPU of the
    largest stage: its weights (`kvlab.specs.sizing.weight_bytes_per_gpu`), its KV bytes per token
    (`kvlab.specs.sizing.kv_bytes_per_token(..., tp, pp)`, heads copied past the KV-head count) and an activation
    estimate whose head and MLP widths are split `tp` ways. The block and sequence counts are then the whole
    deployment's: every GPU of a stage holds the same blocks. `enforce_eager` captures no CUDA graphs;
    `estimate_cuda_graphs=False` is `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0` (and vLLM before 0.21, or v0):
    the graphs are captured but not charged to the pool.

    `speculative=K` with a `draft` model (a registry name, id or config) or `draft_layers` (an EAGLE-style head
    of that many layers of the target's attention shape): the drafter's weights and cache layers and the 2K
    slots per running sequence enter the budget (see the module docstring); `max_model_len` (the model's limit
    when None) caps a sequence's slots. `speculative=0` with no drafter is the budget without speculation.

    An image-text model's encoder cache (`kvlab.specs.images.encoder_cache`) is charged beside the profile run's
    peak, as vLLM reserves it, unless `limit_images=0` (vLLM's `--limit-mm-per-prompt '{"image": 0}'`, a
    text-only server). Where kvlab has no image rule for the model, the budget says so in a "not counted" line.
    """
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
    if max_model_len is None and not enable_chunked_prefill:
        max_model_len = shape(config).max_context
    batch = vllm_defaults.batch_defaults(
        spec.memory_bytes,
        spec.name,
        usage_context,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=max_model_len,
    )
    tokens = batch.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    seqs = batch.max_num_seqs if max_num_seqs is None else max_num_seqs
    check_count("max_num_batched_tokens", tokens)
    check_count("max_num_seqs", seqs)
    rows = min(seqs, tokens)
    act_dtype = weight_dtype if isinstance(weight_dtype, str) else "bf16"  # quantized weights compute in bf16
    where = "chosen" if max_num_batched_tokens is None else "given"
    if activation_bytes is None:
        forward = forward_peak_bytes(config, tokens, act_dtype, tp=tp)
        sampler = sampler_peak_bytes(config, rows)
        forward_source = f"estimate, {tokens:,} batched tokens"
        sampler_source = f"estimate, {rows:,} rows of logits"
    else:
        forward, sampler = activation_bytes, 0
        forward_source, sampler_source = "measured (profiled forward and sampler)", "none counted"
    graphs = (
        0
        if enforce_eager or not estimate_cuda_graphs
        else cuda_graph_bytes(config, seqs, tokens, act_dtype, tp=tp)
    )
    target_kv = kv_bytes_per_token(config, kv_dtype, tp=tp, pp=pp)
    plain = MemoryBudget(
        capacity_bytes=spec.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        runtime_bytes=non_torch_bytes(tp) if runtime_bytes is None else runtime_bytes,
        weight_bytes=weight_bytes_per_gpu(config, weight_dtype, tp=tp, pp=pp),
        activation_bytes=forward,
        block_size=block_size,
        kv_bytes_per_token=target_kv,
        runtime_source=(
            f"estimate at TP={tp} (kvlab.costs.budget.non_torch_bytes)"
            if runtime_bytes is None
            else "measured (vLLM's non_torch_memory)"
        ),
        activation_source=forward_source,
        driver_reserved_bytes=DRIVER_RESERVED_BYTES
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
        cuda_graph_source=f"estimate, {len(cuda_graph_sizes(seqs, tokens))} capture sizes (measured: vLLM's log)",
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


@dataclass(frozen=True)
class BudgetSettings:
    """The engine settings a memory budget depends on, vLLM's names and defaults (`kvlab.specs.vllm_defaults`): what
    `kvlab size --gpu`, `kvlab.planning.plan` and `kvlab.planning.diagnose` size the pool with, each keyword of `memory_budget`
    once. `max_num_batched_tokens` and `max_num_seqs` left None are vLLM's choice for the GPU (`resolved`)."""

    kv_dtype: str = "bf16"
    weight_dtype: str | int = "bf16"
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int = BLOCK_SIZE
    tp: int = 1
    pp: int = 1
    usage_context: str = vllm_defaults.USAGE_CONTEXT
    enable_chunked_prefill: bool = vllm_defaults.ENABLE_CHUNKED_PREFILL
    max_model_len: int | None = None
    enforce_eager: bool = False
    estimate_cuda_graphs: bool = vllm_defaults.ESTIMATE_CUDA_GRAPHS
    speculative: int = 0  # K speculative tokens; 0 is off
    draft: str | None = None  # the draft model (vLLM's method "draft_model")
    draft_layers: int = 0  # or an EAGLE-style head of this many layers of the target's shape
    # images a prompt may carry (vLLM's --limit-mm-per-prompt); 0 is a text-only server, no encoder cache
    limit_images: int | None = None

    def __post_init__(self) -> None:
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
        max_model_len = self.max_model_len
        if max_model_len is None and not self.enable_chunked_prefill and config is not None:
            max_model_len = shape(config).max_context
        batch = vllm_defaults.batch_defaults(
            spec.memory_bytes,
            spec.name,
            self.usage_context,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=max_model_len,
        )
        return (
            self.max_num_batched_tokens or batch.max_num_batched_tokens,
            self.max_num_seqs or batch.max_num_seqs,
        )

    def memory_budget(self, config: PretrainedConfig | str, gpu: str | hardware.Accelerator) -> MemoryBudget:
        """`memory_budget` of `config` on `gpu` at these settings."""
        return memory_budget(config, gpu, **dataclasses.asdict(self))
