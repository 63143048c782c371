"""What a vLLM server's start-up log says about its memory, read from the log text.

vLLM prints its KV budget at start-up, in words that changed between versions. This module reads both families:

- **v1** (the V1 engine, vLLM >= 0.8): "Initializing a V1 LLM engine (vX) with config: model=..., ...",
  "Model loading took X GiB", "Available KV cache memory: X GiB", "GPU KV cache size: N tokens",
  "Maximum concurrency for N tokens per request: Xx" (vllm/v1/worker/gpu_worker.py and
  vllm/v1/core/kv_cache_utils.py; the token line replaced "# GPU blocks" in vllm-project/vllm#13596);
- **v0** (the older engine): "Loading model weights took X GB", then one of "Memory profiling results:
  total_gpu_memory=... non_torch_memory=... kv_cache_size=..." (vLLM 0.6.4) or "the current vLLM instance can use
  total_gpu_memory (X GiB) x gpu_memory_utilization (U)" with "model weights take ...; non_torch_memory takes ...;
  PyTorch activation peak memory takes ...; the rest of the memory reserved for KV Cache is ..." (vllm/worker/
  worker.py, vllm-project/vllm#10511), and "# GPU blocks: N" (or "# CUDA blocks: N").

Newer v1 workers also print the whole ledger on one line: "Free memory on device (F/T GiB) on startup. Desired
GPU memory utilization is (U, X GiB). Actual usage is A GiB for consumed memory (weights + non-torch), B GiB for
peak activation, and C GiB for CUDAGraph memory. ... Current kv cache memory in use is K GiB." (as posted in
wtdcode/vllm-backport#34). It gives the total, the utilisation, weights and non-torch memory as one figure, the
activation peak, the graphs' actual memory and the pool; with "Model loading took" beside it, non-torch memory is
the difference (`StartupLog.non_torch_memory`).

vLLM 0.34.0's extensible KV cache (vllm/v1/worker/extensible_kv_cache.py) adds "Memory after warmup: F GiB free, C GiB
committed to the KV cache, T GiB kept for transient activations (P GiB allocated at peak, G GiB of torch reservation
growth); N KV cache blocks (S GiB) fit within the requested R GiB. Torch may reserve up to L GiB.", "Extended KV cache
to N blocks (X GiB).", "Remapping the KV cache from A to B blocks ...", a warning when "gpu_memory_utilization=U caps
this instance at R GiB, keeping W GiB of free device memory out of the KV cache", and "Disabling the extensible KV
cache: reason" (vllm/v1/executor/abstract.py); "Available KV cache memory" is then only the reservation. 0.33 and 0.34
print "CUDA graph pool memory: A GiB (actual), E GiB (estimated)" (vllm/v1/worker/gpu_worker.py).

Both families print sizes in units of 2**30 bytes, even where the word is "GB" (vLLM divides by `GiB_bytes`), so
both convert with 2**30. Published logs are kept in tests/data/vllm_logs/ with their sources. Used by
`kvlab explain-vllm` (`kvlab.planning.explain_vllm`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

GiB = 2**30
# vLLM's default --block-size on CUDA (vllm/config/cache.py), what the token count is when only blocks are printed
DEFAULT_BLOCK_SIZE = 16

_NUMBER = r"(-?[\d,]+(?:\.\d+)?)"


@dataclass(frozen=True)
class Printed:
    """A size vLLM printed: bytes, and half the last printed digit (the rounding of the figure), in bytes."""

    bytes: int
    half_ulp_bytes: int


@dataclass(frozen=True)
class StartupLog:
    """The memory facts of one vLLM start-up log; None where the log does not print them."""

    format: str  # "v1" or "v0"
    vllm_version: str | None
    model: str | None
    dtype: str | None
    max_seq_len: int | None
    tensor_parallel_size: int | None
    kv_cache_dtype: str | None
    enforce_eager: bool | None
    block_size: int | None
    gpu_memory_utilization: float | None
    max_num_batched_tokens: int | None
    total_gpu_memory: Printed | None
    weights: Printed | None
    non_torch: Printed | None
    activation_peak: Printed | None
    cuda_graph: Printed | None
    available_kv: Printed | None
    kv_cache_tokens: int | None
    num_gpu_blocks: int | None
    max_concurrency: float | None
    max_concurrency_tokens: int | None
    # The one-line ledger's "consumed memory (weights + non-torch)"
    weights_and_non_torch: Printed | None = None
    # A hybrid model's page alignment: "Setting attention block size to N tokens", "Padding mamba page size by X%"
    hybrid_block_size: int | None = None
    state_padding_percent: float | None = None
    # vLLM 0.34's measured sizing (the "Memory after warmup" line and the ones after it)
    warmup_free: Printed | None = None
    warmup_committed: Printed | None = None
    transient_kept: Printed | None = None
    transient_peak: Printed | None = None
    torch_growth: Printed | None = None
    measured_blocks: int | None = None
    measured_kv: Printed | None = None
    requested: Printed | None = None
    extended_blocks: int | None = None
    extended_kv: Printed | None = None
    remapped_from_blocks: int | None = None
    withheld: Printed | None = None  # what a utilisation just under 1.0 keeps out of the cache
    extensible_disabled: str | None = None  # why vLLM fell back to the estimate rule
    graph_actual: Printed | None = None  # "CUDA graph pool memory: A GiB (actual)"
    graph_estimated: Printed | None = None
    startup_free: Printed | None = None  # the one-line ledger's "Free memory on device (F/T GiB) on startup"
    v0_lines: tuple[str, ...] = ()  # the v0 engine's memory lines the log holds (a mixed log has 0.34's too)

    @property
    def measured(self) -> bool:
        """Whether the log shows 0.34's measured sizing (any of its lines)."""
        return self.warmup_free is not None or self.extended_blocks is not None

    @property
    def non_torch_memory(self) -> Printed | None:
        """Memory outside PyTorch: as printed, or the one-line ledger's weights + non-torch less the printed
        weights (their roundings add)."""
        if self.non_torch is not None:
            return self.non_torch
        if self.weights_and_non_torch is None or self.weights is None:
            return None
        both, weights = self.weights_and_non_torch, self.weights
        return Printed(both.bytes - weights.bytes, both.half_ulp_bytes + weights.half_ulp_bytes)

    @property
    def tokens(self) -> int | None:
        """KV token slots: the printed count, or blocks × the block size (vLLM's default when unprinted)."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks * (self.block_size or DEFAULT_BLOCK_SIZE)
        return None

    def printed_bytes(self) -> dict[str, int | float | None]:
        """The printed numbers in tests/data/vllm_logs/index.json's `printed` layout; a 0.34 log adds
        `extended_kv_bytes`, its measured pool."""

        def size(value: Printed | None) -> int | None:
            return None if value is None else value.bytes

        return {
            "weights_bytes": size(self.weights),
            "non_torch_bytes": size(self.non_torch),
            "weights_and_non_torch_bytes": size(self.weights_and_non_torch),
            "activation_peak_bytes": size(self.activation_peak),
            "cuda_graph_bytes": size(self.cuda_graph),
            "available_kv_bytes": size(self.available_kv),
            "kv_cache_tokens": self.kv_cache_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_concurrency": self.max_concurrency,
            "max_concurrency_tokens": self.max_concurrency_tokens,
        } | ({} if not self.measured else {"extended_kv_bytes": size(self.extended_kv or self.measured_kv)})


def _size(text: str, *patterns: str) -> Printed | None:
    """The first pattern's figure (GiB, or GB meaning GiB; MiB) in bytes, with its rounding."""
    for pattern in patterns:
        found = re.search(pattern, text)
        if found:
            digits = Decimal(found.group(1).replace(",", ""))
            unit = GiB if found.group(2) in ("GiB", "GB") else 2**20
            exponent = digits.as_tuple().exponent
            step = Decimal(1).scaleb(exponent if isinstance(exponent, int) else 0)
            return Printed(int(round(digits * unit)), int(step * unit / 2))
    return None


def _int(text: str, *patterns: str) -> int | None:
    for pattern in patterns:
        found = re.search(pattern, text)
        if found:
            return int(found.group(1).replace(",", ""))
    return None


def _word(text: str, pattern: str) -> str | None:
    found = re.search(pattern, text)
    return found.group(1) if found else None


def parse(text: str) -> StartupLog:
    """Read a vLLM start-up log; a ValueError names what is missing when it is not one."""
    available = _size(
        text,
        rf"Available KV cache memory: {_NUMBER} ?(GiB|MiB)",
        rf"reserved for KV Cache is {_NUMBER} ?(GiB)",
        rf"kv_cache_size={_NUMBER} ?(GiB)",
        rf"Current kv cache memory in use is {_NUMBER} ?(GiB)",
    )
    tokens = _int(text, rf"GPU KV cache size: {_NUMBER} tokens")
    blocks = _int(text, r"(?:GPU|CUDA) blocks: (\d+)", r"num_gpu_blocks is: (\d+)")
    if available is None and tokens is None and blocks is None and "Extended KV cache to" not in text:
        raise ValueError(
            "not a vLLM start-up log: found none of 'Available KV cache memory', "
            "'GPU KV cache size', '# GPU blocks', 'Current kv cache memory in use'"
        )
    concurrency = re.search(rf"Maximum concurrency for {_NUMBER} tokens per request: ([\d.]+)x", text)
    v1_markers = (
        "V1 LLM engine",
        "GPU KV cache size",
        "Available KV cache memory",
        "kv_cache_utils.py",
        "gpu_worker.py",
    )
    eager = _word(text, r"enforce_eager=(True|False)")
    dtype = _word(text, r"\bdtype(?:=|': ')(?:torch\.)?(\w+)")
    utilization = (
        _word(text, r"gpu_memory_utilization(?:=| \(|'?: )(\d+(?:\.\d+)?)")
        or _word(
            # vLLM >= 0.21's CUDA-graph profiling line names the setting by its flag
            text,
            r"The current --gpu-memory-utilization=(\d+(?:\.\d+)?)",
        )
        or _word(text, r"Desired GPU memory utilization is \((\d+(?:\.\d+)?),")
    )
    padding = _word(text, r"Padding mamba page size by (\d+(?:\.\d+)?)%")
    g = r"(-?[\d.]+) ?(GiB)"
    warmup = re.search(
        rf"Memory after warmup: {g} free, {g} committed to the KV cache, {g} kept for transient activations "
        rf"\({g} allocated at peak, {g} of torch reservation growth\); (\d+) KV cache blocks \({g}\) fit "
        rf"within the requested {g}",
        text,
    )

    def part(index: int) -> Printed | None:
        return None if warmup is None else _size(f"{warmup.group(index)} GiB", rf"{g}")

    disabled = _word(text, r"Disabling the extensible KV cache: (.+?)\. The KV cache will be sized")
    return StartupLog(
        format="v1" if any(marker in text for marker in v1_markers) else "v0",
        vllm_version=_word(text, r"LLM engine \(v([^)\s]+)\)") or _word(text, r"API server version (\S+)"),
        model=_word(text, r"\bmodel='([^']+)'"),
        dtype=dtype,
        max_seq_len=_int(text, r"max_seq_len=(\d+)", r"'max_model_len': (\d+)", r"Using max model len (\d+)"),
        tensor_parallel_size=_int(text, r"tensor_parallel_size(?:=|': )(\d+)"),
        kv_cache_dtype=_word(text, r"kv_cache_dtype(?:=|': ')(\w+)"),
        enforce_eager=None if eager is None else eager == "True",
        block_size=_int(text, r"\bblock_size=(\d+)", r"Block size is set to (\d+)"),
        gpu_memory_utilization=None if utilization is None else float(utilization),
        max_num_batched_tokens=_int(text, r"max_num_batched_tokens(?:=|': )(\d+)"),
        total_gpu_memory=_size(
            text,
            rf"total_gpu_memory(?:=| \(){_NUMBER} ?(GiB)",
            rf"Free memory on device \([\d.]+/{_NUMBER} ?(GiB)\)",
        ),
        weights=_size(
            text,
            rf"Loading model weights took {_NUMBER} ?(GiB|GB)",
            rf"Model loading took {_NUMBER} ?(GiB|GB)",
            rf"model weights take {_NUMBER} ?(GiB)",
        ),
        non_torch=_size(text, rf"non_torch_memory(?: takes |=){_NUMBER} ?(GiB)"),
        activation_peak=_size(
            text,
            rf"PyTorch activation peak memory takes {_NUMBER} ?(GiB)",
            rf"{_NUMBER} ?(GiB) for peak activation",
        ),
        # the estimate where printed (what the budget subtracted), else the ledger's measured figure
        cuda_graph=_size(
            text,
            rf"Estimated CUDA graph memory: {_NUMBER} ?(GiB|MiB)",
            rf"{_NUMBER} ?(GiB) for CUDAGraph memory",
        ),
        available_kv=available,
        kv_cache_tokens=tokens,
        num_gpu_blocks=blocks,
        max_concurrency=None if concurrency is None else float(concurrency.group(2)),
        max_concurrency_tokens=None if concurrency is None else int(concurrency.group(1).replace(",", "")),
        weights_and_non_torch=_size(
            text, rf"Actual usage is {_NUMBER} ?(GiB) for consumed memory \(weights \+ non-torch\)"
        ),
        hybrid_block_size=_int(text, r"Setting attention block size to (\d+) tokens"),
        state_padding_percent=None if padding is None else float(padding),
        warmup_free=part(1),
        warmup_committed=part(3),
        transient_kept=part(5),
        transient_peak=part(7),
        torch_growth=part(9),
        measured_blocks=None if warmup is None else int(warmup.group(11)),
        measured_kv=part(12),
        requested=part(14),
        extended_blocks=_int(text, r"Extended KV cache to (\d+) blocks"),
        extended_kv=_size(text, rf"Extended KV cache to \d+ blocks \({_NUMBER} ?(GiB)\)"),
        remapped_from_blocks=_int(text, r"Remapping the KV cache from (\d+) to \d+ blocks"),
        withheld=_size(text, rf"GiB, keeping {_NUMBER} ?(GiB) of free device memory out of the KV cache"),
        extensible_disabled=disabled,
        graph_actual=_size(text, rf"CUDA graph pool memory: {_NUMBER} ?(GiB) \(actual\)"),
        graph_estimated=_size(
            text, rf"CUDA graph pool memory: [\d.]+ ?GiB \(actual\), {_NUMBER} ?(GiB) \(estimated\)"
        ),
        startup_free=_size(text, rf"Free memory on device \({_NUMBER} ?/[\d.]+ ?(GiB)\)"),
        v0_lines=tuple(
            marker
            for marker in ("Memory profiling results", "the current vLLM instance can use", "# GPU blocks")
            if marker in text
        ),
    )
