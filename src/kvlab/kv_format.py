"""How K and V are stored in 8 bits: the int8 and fp8 quantizers, and the engine pool's storage format.

`quantize_int8` / `quantize_fp8` turn the last dimension of a tensor (a head's `head_dim` channels) into one-byte
codes and one fp16 scale per row; `dequantize_*` reverse them. `pool_format(kv_cache_dtype)` names the format an
engine pool stores (`EngineConfig(kv_cache_dtype=...)`, read by `kvlab.engine.kv_pool.KVPool`): vLLM's
`--kv-cache-dtype` names, with the bytes one token of one head takes. The transformers cache layers built on the
same quantizers, and their accuracy, live in `kvlab.experiments.quant`. This module imports nothing from kvlab, so that the
pool, the engine's configuration and the measurements can all depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
FP8_DTYPE = torch.float8_e4m3fn
# 448: the largest finite float8 e4m3 value.
FP8_MAX = torch.finfo(FP8_DTYPE).max
# The smallest positive fp16 scale: keeps an all-zero row's scale positive, so dequantizing it gives zeros.
TINY_SCALE = torch.finfo(SCALE_DTYPE).tiny


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension: codes in [-127, 127] and one fp16 scale per row."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127).clamp(min=TINY_SCALE).to(SCALE_DTYPE)
    codes = torch.round(x.float() / scale.float()).clamp(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float()).to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 over the last dimension: each row scaled so its largest magnitude maps to 448."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=TINY_SCALE).to(SCALE_DTYPE)
    codes = (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float()).to(dtype)


# vLLM's `--kv-cache-dtype` names: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3") and kvlab's "int8"
# store one byte per element plus one fp16 scale per token and head, quantized on write, dequantized on read.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")


@dataclass(frozen=True)
class PoolFormat:
    """How an engine pool stores K/V: `code_dtype` None keeps the model's dtype (no scales)."""

    name: str
    code_dtype: torch.dtype | None
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None

    @property
    def quantized(self) -> bool:
        return self.code_dtype is not None

    def bytes_per_head_token(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token of one K (or V) head takes: codes plus its fp16 scale, or `head_dim` model elements."""
        if self.code_dtype is None:
            return head_dim * dtype.itemsize
        return head_dim * self.code_dtype.itemsize + SCALE_DTYPE.itemsize


def pool_format(kv_cache_dtype: str) -> PoolFormat:
    """The `PoolFormat` of a `kv_cache_dtype` name; a `ValueError` lists the known names."""
    if kv_cache_dtype == "auto":
        return PoolFormat("auto", None, None)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return PoolFormat("fp8", FP8_DTYPE, quantize_fp8)
    if kv_cache_dtype == "int8":
        return PoolFormat("int8", torch.int8, quantize_int8)
    raise ValueError(
        f"unknown kv_cache_dtype {kv_cache_dtype!r}; known: {', '.join(KV_CACHE_DTYPES)} "
        "('auto' = the model's dtype)"
    )
