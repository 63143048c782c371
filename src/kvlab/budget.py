"""The memory budget: what is left for KV blocks once everything else has taken its share of the GPU.

The whole GPU is never available to the cache. Term by term, the way vLLM sizes its pool at startup
(vLLM v1 `gpu_worker.determine_available_memory`: requested memory = total × `gpu_memory_utilization`, less
weights, peak activation and memory outside PyTorch):

1. **capacity**: what the driver reports (`kvlab.hardware`: the `nvidia-smi` total);
2. **engine cap**: the engine keeps `1 - gpu_memory_utilization` of it unused (vLLM's default is 0.9, the
   `--gpu-memory-utilization` engine argument, https://docs.vllm.ai/en/latest/configuration/engine_args.html);
3. **CUDA context and runtime**: driver, CUDA context, cuBLAS/NCCL workspaces, held outside PyTorch's
   allocator. Measured on a GPU by `kvlab.measure.cuda_context_bytes`; elsewhere the default is 781 MiB, what
   `nvidia-smi` showed for a process that had only initialised CUDA in PyTorch (pytorch/pytorch#34323). vLLM
   counts this inside its 10 % headroom; kvlab subtracts it on top, so its pool is never larger than vLLM's
   at the same settings;
4. **weights**: parameters × bytes (`kvlab.sizing.weight_bytes`);
5. **activation workspace**: the peak of a forward over the largest token batch the scheduler admits
   (`max_num_batched_tokens`). An engine measures it by profiling a dummy forward (`kvlab.engine` does, like
   vLLM); without a model at hand, `activation_workspace_bytes` estimates it from the config;
6. **block rounding**: the pool holds whole blocks of `block_size` tokens, and a sequence holds whole blocks.

`MemoryBudget` is the one place a KV budget is computed: `kvlab size --gpu`, the chapters' "N sequences fit"
figures and the engine's pool all come from it. Chapters: *Active tokens, not batch size* (book/05_active_tokens),
*Long context* (book/06_long_context).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab import hardware
from kvlab.checks import check_count
from kvlab.shape import prepare, shape
from kvlab.units import MiB, dtype_bytes, format_bytes, format_tokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
CUDA_CONTEXT_BYTES = 781 * MiB  # nvidia-smi after CUDA init in PyTorch (pytorch/pytorch#34323)
MAX_NUM_BATCHED_TOKENS = 8192  # vLLM v1's default token budget per step for online serving
MAX_NUM_SEQS = 256  # vLLM's default --max-num-seqs
BLOCK_SIZE = 16  # vLLM's default --block-size on GPUs
DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")  # the weight and KV precisions `BudgetSettings` takes


@dataclass(frozen=True)
class MemoryBudget:
    """Where a device's memory goes, term by term, and how many KV blocks the rest holds."""

    capacity_bytes: int
    gpu_memory_utilization: float
    runtime_bytes: int  # CUDA context, driver and library workspaces, outside PyTorch's allocator
    weight_bytes: int
    activation_bytes: int  # peak activation workspace of the largest step
    block_size: int  # tokens per block
    kv_bytes_per_token: int  # all layers, while every layer still grows
    runtime_source: str = f"default {format_bytes(CUDA_CONTEXT_BYTES)} (pytorch/pytorch#34323)"
    activation_source: str = "estimate (kvlab.budget.activation_workspace_bytes)"

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("capacity_bytes", "runtime_bytes", "weight_bytes", "activation_bytes"):
            check_count(name, getattr(self, name), 0)
        for name in ("block_size", "kv_bytes_per_token"):
            check_count(name, getattr(self, name))

    @property
    def engine_cap_bytes(self) -> int:
        """Bytes the engine leaves unused: capacity × (1 - gpu_memory_utilization), rounded up."""
        return self.capacity_bytes - math.floor(self.capacity_bytes * self.gpu_memory_utilization)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def kv_headroom_bytes(self) -> int:
        """What the other terms leave for the cache; negative when they alone do not fit."""
        return (
            self.capacity_bytes
            - self.engine_cap_bytes
            - self.runtime_bytes
            - self.weight_bytes
            - self.activation_bytes
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

    def blocks_per_sequence(self, context_len: int) -> int:
        """Blocks one sequence of `context_len` tokens holds (the last one partly empty)."""
        return -(-check_count("context_len", context_len) // self.block_size)

    def max_sequences(self, context_len: int) -> int:
        """How many sequences of `context_len` tokens the pool holds at once, in whole blocks (a lower bound
        for models with sliding-window layers, whose blocks an engine may free behind the window)."""
        return self.num_blocks // self.blocks_per_sequence(context_len)

    def max_tokens(self) -> int:
        """Token slots in the pool, summed over sequences."""
        return self.num_blocks * self.block_size

    def lines(self, context_len: int | None = None) -> list[str]:
        """The budget, one term a line, each with where its figure comes from."""

        def row(label: str, value: int, note: str) -> str:
            return f"  {label:<22}{format_bytes(value):>11}   {note}"

        out = [
            row("capacity", self.capacity_bytes, "what the driver reports"),
            row(
                "- engine cap",
                self.engine_cap_bytes,
                f"1 - gpu_memory_utilization ({self.gpu_memory_utilization:g}; vLLM's default is 0.9)",
            ),
            row("- CUDA context/runtime", self.runtime_bytes, self.runtime_source),
            row("- weights", self.weight_bytes, "parameters × bytes"),
            row("- activations", self.activation_bytes, self.activation_source),
        ]
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
        if context_len is not None:
            out.append(
                f"  sequences that fit    {self.max_sequences(context_len):>11,}   of {format_tokens(context_len)} "
                f"tokens ({self.blocks_per_sequence(context_len)} blocks each)"
            )
        return out


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
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = MAX_NUM_SEQS,
    block_size: int = BLOCK_SIZE,
    tp: int = 1,
    pp: int = 1,
) -> MemoryBudget:
    """The budget of serving `config` on `gpu` (a spec-table name or entry) with vLLM's defaults.

    Pass `runtime_bytes` measured by `kvlab.measure.cuda_context_bytes` and `activation_bytes` measured by a
    profiled forward to replace the defaults. With `tp` tensor-parallel ranks and `pp` pipeline stages it is
    the budget of ONE GPU of the largest stage: its weights (`kvlab.sizing.weight_bytes_per_gpu`), its KV bytes
    per token (`kvlab.sizing.kv_bytes_per_token(..., tp, pp)`, heads copied past the KV-head count) and an
    activation estimate whose head and MLP widths are split `tp` ways. The block and sequence counts are then
    the whole deployment's: every GPU of a stage holds the same blocks.
    """
    from kvlab.sizing import kv_bytes_per_token, weight_bytes_per_gpu

    spec = hardware.get(gpu) if isinstance(gpu, str) else gpu
    config = prepare(config)
    act_dtype = weight_dtype if isinstance(weight_dtype, str) else "bf16"  # quantized weights compute in bf16
    return MemoryBudget(
        capacity_bytes=spec.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        runtime_bytes=CUDA_CONTEXT_BYTES if runtime_bytes is None else runtime_bytes,
        weight_bytes=weight_bytes_per_gpu(config, weight_dtype, tp=tp, pp=pp),
        activation_bytes=(
            activation_workspace_bytes(config, max_num_batched_tokens, max_num_seqs, act_dtype, tp=tp)
            if activation_bytes is None
            else activation_bytes
        ),
        block_size=block_size,
        kv_bytes_per_token=kv_bytes_per_token(config, kv_dtype, tp=tp, pp=pp),
        runtime_source=(
            f"default {format_bytes(CUDA_CONTEXT_BYTES)} (pytorch/pytorch#34323)"
            if runtime_bytes is None
            else "measured (kvlab.measure.cuda_context_bytes)"
        ),
        activation_source=(
            f"estimate for {max_num_batched_tokens:,} batched tokens, {max_num_seqs} sampled rows"
            if activation_bytes is None
            else "measured (profiled forward)"
        ),
    )


@dataclass(frozen=True)
class BudgetSettings:
    """The engine settings a memory budget depends on, vLLM's names and defaults: what `kvlab size --gpu`,
    `kvlab.plan` and `kvlab.diagnose` size the pool with, each keyword of `memory_budget` once."""

    kv_dtype: str = "bf16"
    weight_dtype: str | int = "bf16"
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = MAX_NUM_SEQS
    block_size: int = BLOCK_SIZE
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "tp", "pp"):
            check_count(name, getattr(self, name))
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

    def memory_budget(self, config: PretrainedConfig | str, gpu: str | hardware.Accelerator) -> MemoryBudget:
        """`memory_budget` of `config` on `gpu` at these settings."""
        return memory_budget(config, gpu, **dataclasses.asdict(self))
