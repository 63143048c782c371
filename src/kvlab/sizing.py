"""How many bytes the KV cache and the weights take, exactly.

Per token and layer the cache holds K and V: ``2 × kv_heads × head_dim`` elements (MLA holds one latent of
``kv_lora_rank + qk_rope_head_dim`` instead). Summed over layers and multiplied by the bytes per element and the
active tokens, this is the whole cache. Sliding-window layers stop growing at ``window - 1`` tokens.
`kv_cache_bytes` equals, to the byte, the tensors a transformers 5.24 `DynamicCache` holds; the tests prove it.
Chapter: *Sizing the cache* (book/02_sizing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from kvlab.arch import ArchSpec, config_cache, describe, resolve
from kvlab.units import dtype_bytes

DType = torch.dtype | str | None


def config_dtype(config: PretrainedConfig) -> DType:
    """The dtype a config declares, else bf16 (what serving stacks default to for these models)."""
    declared = getattr(config.get_text_config(decoder=True), "dtype", None) or getattr(config, "dtype", None)
    return declared if declared is not None else "bf16"


def _spec_and_bytes(config: PretrainedConfig | str, dtype: DType) -> tuple[ArchSpec, int]:
    config = resolve(config)
    return describe(config), dtype_bytes(config_dtype(config) if dtype is None else dtype)


def check_count(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def kv_bytes_per_token(config: PretrainedConfig | str, dtype: DType = None) -> int:
    """Bytes one more token adds to one sequence's cache at short context (every layer still growing)."""
    spec, nbytes = _spec_and_bytes(config, dtype)
    return sum(layer.elements_per_token for layer in spec.layers) * nbytes


def kv_bytes_per_token_expanded(config: PretrainedConfig | str, dtype: DType = None) -> int:
    """Per-token bytes if every layer kept per-head K and V (for MLA: what the latent replaces)."""
    spec, nbytes = _spec_and_bytes(config, dtype)
    return sum(layer.expanded_elements_per_token for layer in spec.layers) * nbytes


def kv_cache_bytes(
    config: PretrainedConfig | str, seq_len: int, batch_size: int = 1, dtype: DType = None
) -> int:
    """Bytes a transformers `DynamicCache` holds after a forward over `batch_size` sequences of `seq_len` tokens.

    `dtype=None` takes the config's declared dtype (bf16 when it declares none).
    """
    check_count("seq_len", seq_len, 0)
    check_count("batch_size", batch_size)
    spec, nbytes = _spec_and_bytes(config, dtype)
    return (
        batch_size
        * nbytes
        * sum(layer.cached_tokens(seq_len) * layer.elements_per_token for layer in spec.layers)
    )


@config_cache
def _param_count(config: PretrainedConfig) -> int:
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # e.g. image-text configs with no causal-LM head class registered
            model = AutoModel.from_config(config)
    # Tied embeddings are one tensor; parameters() already yields it once.
    return sum(p.numel() for p in model.parameters())


def param_count(config: PretrainedConfig | str) -> int:
    """Parameters of the model a config describes, counted on the `meta` device (nothing is allocated)."""
    return _param_count(resolve(config))


def weight_bytes(config: PretrainedConfig | str, dtype_or_bits: DType | int = None) -> int:
    """Bytes of the weights: parameters × bytes per element, or × bits / 8 for an int (e.g. 4 for 4-bit).

    Quantization scales and zero points are not counted, so this is the floor a quantized checkpoint reaches.
    """
    params = param_count(config)
    if isinstance(dtype_or_bits, int) and not isinstance(dtype_or_bits, bool):
        if dtype_or_bits not in (1, 2, 3, 4, 5, 6, 8, 16, 32):
            raise ValueError(f"weight bits must be one of 1-6, 8, 16 or 32, got {dtype_or_bits}")
        return math.ceil(params * dtype_or_bits / 8)
    if isinstance(dtype_or_bits, bool):
        raise ValueError(f"weight precision must be a dtype or a bit count, got {dtype_or_bits!r}")
    config = resolve(config)
    return params * dtype_bytes(config_dtype(config) if dtype_or_bits is None else dtype_or_bits)


def crossover_context(
    config: PretrainedConfig | str, batch_size: int = 1, dtype: DType = None, weight_dtype: DType | int = None
) -> int | None:
    """Smallest context at which `batch_size` sequences' cache reaches the weights' bytes; None if never.

    Sliding-window layers stop growing, so a model whose every layer slides may never get there.
    """
    check_count("batch_size", batch_size)
    target = weight_bytes(config, weight_dtype)
    spec, _ = _spec_and_bytes(config, dtype)
    if not spec.grows:
        longest = max(layer.max_cached_tokens or 0 for layer in spec.layers)
        if kv_cache_bytes(config, longest, batch_size, dtype) < target:
            return None
    # kv_cache_bytes is non-decreasing in seq_len: bisect.
    lo, hi = 0, 1
    while kv_cache_bytes(config, hi, batch_size, dtype) < target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv_cache_bytes(config, mid, batch_size, dtype) >= target:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class ModelSize:
    """The numbers the sizing chapter tabulates for one model."""

    name: str
    attention_type: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    params: int
    weight_bytes: int
    max_context: int | None


def model_size(
    config: PretrainedConfig | str, kv_dtype: DType = "bf16", weight_dtype: DType | int = "bf16"
) -> ModelSize:
    config = resolve(config)
    spec = describe(config)
    text = config.get_text_config(decoder=True)
    return ModelSize(
        name=spec.name,
        attention_type=spec.attention_type,
        layers=spec.num_layers,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        kv_bytes_per_token=kv_bytes_per_token(config, kv_dtype),
        params=param_count(config),
        weight_bytes=weight_bytes(config, weight_dtype),
        max_context=getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None),
    )


def rank_inversions(sizes: list[ModelSize]) -> list[tuple[ModelSize, ModelSize]]:
    """Pairs (small, big) where the model with fewer parameters needs more KV bytes per token."""
    return [
        (a, b)
        for a in sizes
        for b in sizes
        if a.params < b.params and a.kv_bytes_per_token > b.kv_bytes_per_token
    ]
