"""SGLang's KV pool: the static fraction of GPU memory, how SGLang picks it, and the tokens it holds.

Read from SGLang 0.5.23 (the PyPI wheel `sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`):
`sglang/srt/arg_groups/memory_hook.py` (`handle_gpu_memory_settings`, which older releases kept in
`sglang/srt/server_args.py` as `ServerArgs._handle_gpu_memory_settings`), `sglang/srt/mem_cache/
kv_cache_configurator.py` (`_profile_available_bytes`) and `sglang/srt/model_executor/pool_configurator.py`
(`calculate_pool_sizes`, `_compute_cell_size`).

SGLang sizes its pool in three steps, unlike vLLM (`kvlab.costs.budget`):

1. **The static fraction.** `--mem-fraction-static` is (weights + KV pool) / GPU memory. The rest,
   `1 - mem_fraction_static` of the memory free before the weights load, is left for activations, CUDA graphs
   and everything else. SGLang measures none of that: it is a fixed share.
2. **Its automatic choice** (`auto_mem_fraction_static`). Without the flag SGLang picks a chunked-prefill size and
   a largest decode CUDA-graph batch by GPU memory and TP size, reserves in MiB
   512 + 1.5 × max(chunk, 2048) + 1024 × tp × pp / 8 + 2 × graph batch + 8 per captured prefill-graph size
   (at least 10 GiB on GPUs above 60 GiB), and sets the fraction to (memory - reserve) / memory, rounded to three
   decimals. An H100 (81,559 MiB) at TP 1 gets 0.830.
3. **The token pool.** After the weights load, rest = free memory - (free before loading) × (1 - fraction), and
   `max_total_num_tokens` = rest // cell size, rounded down to whole pages. The cell size of a dense or GQA
   model is kv_heads per rank × (head_dim + v_head_dim) × layers × bytes: the same bytes per token as vLLM's
   (`kvlab.specs.sizing.kv_bytes_per_token`). The log prints it as "KV Cache is allocated. #tokens: N, K size: X GB,
   V size: X GB" (GB there means GiB) and "max_total_num_tokens=N".

**Why vLLM and SGLang report pools about 2x apart for one model.** The bytes per token agree; the budgets do
not. vLLM gives the cache `gpu_memory_utilization` of the GPU less the weights AND a profiled activation peak,
non-torch memory and (by version) CUDA-graph memory. SGLang gives it `mem_fraction_static` of the free memory
less the weights only: its activations live in the fixed remainder. When the weights fill most of the GPU the
two remainders differ by several GiB, a large share of a small pool. vllm-project/vllm#21348 shows it:
Qwen3-235B-A22B-FP8 on 4 H100s, vLLM "Available KV cache memory: 8.11 GiB" (178,880 tokens) against SGLang at
`--mem-fraction-static 0.93` "#tokens: 367404, K size: 8.23 GB, V size: 8.23 GB", 2.05x the tokens at the same
48 KiB per token. A second cause, for MLA models in older vLLM releases, was the layout itself
(vllm-project/vllm#8455, DeepSeek-V2.5: vLLM cached expanded per-head K and V where SGLang cached the latent).

kvlab models SGLang's defaults on CUDA for a text model: no speculative decoding, no DP attention, no
disaggregation, decode and (breakable) prefill CUDA graphs on, post-capture sizing off (SGLang's default).
Models with sliding-window layers get SGLang's separate full and SWA pools, which kvlab does not model: they are
refused with a one-line error. Chapter: *Active tokens, not batch size* (book/05_active_tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.checks import check_count
from kvlab.specs import hardware
from kvlab.specs.shape import prepare, shape
from kvlab.units import GiB, MiB, format_bytes, format_tokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SGLANG_VERSION = "0.5.23"
# SGLang's page size on CUDA with its default attention backends: one token a page
PAGE_SIZE = 1


@dataclass(frozen=True)
class GraphDefaults:
    """What SGLang picks from the GPU's memory and the TP size before it sets the fraction."""

    chunked_prefill_size: int
    # largest decode batch captured in a CUDA graph
    cuda_graph_max_bs: int


def graph_defaults(gpu_mem_mib: float, tp: int = 1) -> GraphDefaults:
    """SGLang 0.5.23's chunked-prefill size and largest decode CUDA-graph batch for a GPU of `gpu_mem_mib` MiB
    (the driver's total) at tensor-parallel size `tp` (`handle_gpu_memory_settings`, by memory tier)."""
    check_count("tp", tp)
    if not gpu_mem_mib > 0:
        raise ValueError(f"gpu_mem_mib must be positive, got {gpu_mem_mib!r}")
    few_ranks = tp < 4
    # (upper bound in GiB, chunked prefill, graph batch below TP 4, graph batch at TP 4 and above)
    tiers = [
        (20, 2048, 8, 8),
        (35, 4096, 48, 160),
        (60, 4096, 32, 160),
        (90, 8192, 256, 512),
        (160, 8192, 256, 512),
    ]
    for limit_gib, chunk, small_tp, large_tp in tiers:
        if gpu_mem_mib < limit_gib * 1024:
            return GraphDefaults(chunk, small_tp if few_ranks else large_tp)
    return GraphDefaults(16384, 512)


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The token counts SGLang 0.5.23 captures prefill CUDA graphs for, up to `max_tokens`
    (`generate_prefill_cuda_graph_batch_sizes`): finer steps for small batches, 512-token steps past 4,096."""
    check_count("max_tokens", max_tokens)
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(4608, max_tokens + 1, 512),
    ]
    return [s for s in sizes if s <= max_tokens]


def reserved_mib(gpu_mem_mib: float, tp: int = 1, pp: int = 1, mla: bool = False) -> float:
    """MiB SGLang 0.5.23 keeps outside the static pool at its defaults: fixed metadata, activations of one
    chunked prefill, a share per GPU of the parallel group, decode and prefill CUDA graphs; 10 GiB at least on
    GPUs above 60 GiB. MLA models' prefill graphs are charged a flat 1.5 GiB, as SGLang does."""
    check_count("pp", pp)
    picked = graph_defaults(gpu_mem_mib, tp)
    chunk = picked.chunked_prefill_size
    reserve = 512 + max(chunk, 2048) * 1.5 + tp * pp / 8 * 1024
    reserve += picked.cuda_graph_max_bs * 2
    # prefill graphs are captured up to the chunk (MLA: at most 8,192 tokens); only their non-torch memory counts
    reserve += 1.5 * 1024 if mla else len(prefill_graph_sizes(chunk)) * 8
    if gpu_mem_mib > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    return reserve


def auto_mem_fraction_static(gpu_mem_mib: float, tp: int = 1, pp: int = 1, mla: bool = False) -> float:
    """SGLang 0.5.23's `mem_fraction_static` when `--mem-fraction-static` is not given:
    (memory - reserve) / memory, rounded to three decimals (`reserved_mib`)."""
    return round((gpu_mem_mib - reserved_mib(gpu_mem_mib, tp, pp, mla)) / gpu_mem_mib, 3)


@dataclass(frozen=True)
class SGLangPool:
    """SGLang's KV pool on one GPU, term by term, and the tokens it holds."""

    capacity_bytes: int
    mem_fraction_static: float
    # CUDA context and runtime, taken before SGLang measures the memory free before loading
    runtime_bytes: int
    weight_bytes: int
    # SGLang's cell size: KV bytes of one token on this GPU, all layers
    cell_bytes: int
    page_size: int = PAGE_SIZE
    fraction_source: str = "given"
    runtime_source: str = "estimate"

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        for name in ("capacity_bytes", "runtime_bytes", "weight_bytes"):
            check_count(name, getattr(self, name), 0)
        for name in ("cell_bytes", "page_size"):
            check_count(name, getattr(self, name))

    @property
    def pre_load_free_bytes(self) -> int:
        """What SGLang's "Load weight begin. avail mem" reports: the memory free before the weights load."""
        return self.capacity_bytes - self.runtime_bytes

    @property
    def headroom_bytes(self) -> int:
        """The fixed remainder left for activations and CUDA graphs: (1 - fraction) of the pre-load free memory."""
        return math.ceil(self.pre_load_free_bytes * (1 - self.mem_fraction_static))

    @property
    def rest_bytes(self) -> int:
        """What the pool may take; negative when the weights alone exceed the static fraction."""
        return self.pre_load_free_bytes - self.weight_bytes - self.headroom_bytes

    @property
    def max_total_num_tokens(self) -> int:
        """SGLang's token count: rest // cell size, in whole pages."""
        return max(self.rest_bytes, 0) // self.cell_bytes // self.page_size * self.page_size

    @property
    def kv_pool_bytes(self) -> int:
        return self.max_total_num_tokens * self.cell_bytes

    @property
    def fits(self) -> bool:
        return self.max_total_num_tokens >= self.page_size

    def min_mem_fraction_static(self) -> float:
        """The smallest fraction that leaves the pool any room: 1 - free after loading / free before, as
        SGLang's "Raise --mem-fraction-static above" error computes it."""
        return 1 - (self.pre_load_free_bytes - self.weight_bytes) / self.pre_load_free_bytes

    def stack(self) -> list[tuple[str, int, str]]:
        """The terms from the capacity down, as (name, bytes, where the figure comes from); with the token
        rounding and the pool (`kvlab size --engine sglang --json`) they sum to the capacity."""
        return [
            ("CUDA context/runtime", self.runtime_bytes, self.runtime_source),
            (
                "headroom",
                self.headroom_bytes,
                f"1 - mem_fraction_static ({self.mem_fraction_static:g}, {self.fraction_source}): "
                "activations, CUDA graphs",
            ),
            ("weights", self.weight_bytes, "parameters × bytes"),
        ]

    def max_sequences(self, context_len: int) -> int:
        """Sequences of `context_len` tokens the pool holds at once (one-token pages: no block rounding)."""
        return self.max_total_num_tokens // check_count("context_len", context_len)

    def lines(self, context_len: int | None = None) -> list[str]:
        """The pool, one term a line, each with where its figure comes from, as `kvlab size --engine sglang`
        prints it."""

        def row(label: str, value: int, note: str) -> str:
            return f"  {label:<24}{format_bytes(value):>11}   {note}"

        out = [
            row("capacity", self.capacity_bytes, "what the driver reports"),
            row("- CUDA context/runtime", self.runtime_bytes, self.runtime_source),
            row(
                "= free before loading", self.pre_load_free_bytes, 'SGLang\'s "Load weight begin. avail mem"'
            ),
            row(
                "- headroom",
                self.headroom_bytes,
                f"1 - mem_fraction_static ({self.mem_fraction_static:g}, {self.fraction_source}): "
                "activations, CUDA graphs",
            ),
            row("- weights", self.weight_bytes, "parameters × bytes"),
        ]
        if not self.fits:
            out.append(
                f"  = does NOT fit: raise --mem-fraction-static above {self.min_mem_fraction_static():.3f}, "
                "or shard the weights (--tp)"
            )
            return out
        out.append(
            row(
                "= KV pool",
                self.kv_pool_bytes,
                f"max_total_num_tokens = {self.max_total_num_tokens:,} × {format_bytes(self.cell_bytes)} a token",
            )
        )
        if context_len is not None:
            out.append(
                f"  sequences that fit      {self.max_sequences(context_len):>11,}   of {format_tokens(context_len)} "
                "tokens"
            )
        return out


def sglang_pool(
    config: PretrainedConfig | str,
    gpu: str | hardware.Accelerator,
    *,
    kv_dtype: str = "bf16",
    weight_dtype: str | int = "bf16",
    mem_fraction_static: float | None = None,
    runtime_bytes: int | None = None,
    tp: int = 1,
    pp: int = 1,
    page_size: int = PAGE_SIZE,
) -> SGLangPool:
    """SGLang's pool for `config` on one GPU of `gpu` at tensor-parallel size `tp` and `pp` stages.

    `mem_fraction_static` None is SGLang's automatic choice for that GPU and TP size. `runtime_bytes` is what
    the CUDA context and runtime hold before the weights load; by default kvlab's one estimate of it
    (`kvlab.costs.budget.CUDA_CONTEXT_BYTES`). A model with sliding-window layers is refused (see the module
    docstring).
    """
    from kvlab.costs.budget import CUDA_CONTEXT_BYTES
    from kvlab.specs.sizing import check_parallel, kv_bytes_per_token, refuse_state, weight_bytes_per_gpu

    spec = hardware.get(gpu) if isinstance(gpu, str) else gpu
    config = prepare(config)
    arch = shape(config).spec
    check_parallel(arch, tp, pp)
    # SGLang keeps Mamba and linear-attention state in a separate pool, which kvlab does not model.
    refuse_state(arch, "kvlab's SGLang pool")
    if "sliding" in arch.kinds:
        raise ValueError(
            f"{arch.name}: sliding-window layers get SGLang's separate full and SWA pools, which kvlab does not "
            "model; size it with --engine vllm"
        )
    gpu_mem_mib = spec.memory_bytes / MiB
    given = mem_fraction_static is not None
    fraction = (
        auto_mem_fraction_static(gpu_mem_mib, tp, pp, mla="mla" in arch.kinds)
        if mem_fraction_static is None
        else mem_fraction_static
    )
    runtime = CUDA_CONTEXT_BYTES if runtime_bytes is None else runtime_bytes
    return SGLangPool(
        capacity_bytes=spec.memory_bytes,
        mem_fraction_static=fraction,
        runtime_bytes=runtime,
        weight_bytes=weight_bytes_per_gpu(config, weight_dtype, tp=tp, pp=pp),
        cell_bytes=kv_bytes_per_token(config, kv_dtype, tp=tp, pp=pp),
        page_size=page_size,
        fraction_source="given" if given else f"SGLang {SGLANG_VERSION}'s choice for {spec.name}, tp={tp}",
        runtime_source=(
            f"estimate: kvlab's default {format_bytes(CUDA_CONTEXT_BYTES)} (pytorch/pytorch#34323)"
            if runtime_bytes is None
            else "given"
        ),
    )


@dataclass(frozen=True)
class AllocatedLine:
    """What SGLang's "KV Cache is allocated. #tokens: N, K size: X GB, V size: Y GB" line states."""

    tokens: int
    k_gib: float
    v_gib: float

    def bytes_per_token(self) -> float:
        """K plus V bytes of one token, from the printed sizes (printed in GiB, two decimals)."""
        return (self.k_gib + self.v_gib) * GiB / self.tokens


def parse_allocated(line: str) -> AllocatedLine:
    """The figures of SGLang's "KV Cache is allocated" line (with or without a "dtype: ..." field); a line
    without them is a one-line error naming what is missing."""
    import re

    found = re.search(r"#tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB", line)
    if found is None:
        raise ValueError(
            f"not SGLang's 'KV Cache is allocated. #tokens: N, K size: X GB, V size: Y GB' line: {line!r}"
        )
    return AllocatedLine(int(found[1]), float(found[2]), float(found[3]))
