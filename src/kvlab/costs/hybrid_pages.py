"""How vLLM pages a hybrid model's state beside its KV blocks, and what making the page sizes equal costs.

vLLM's hybrid KV cache manager cuts one pool into pages of one size for every layer
(docs.vllm.ai, design/hybrid_kv_cache_manager). An attention layer holds a page per `block_size` tokens; a
Mamba or linear-attention layer holds one page per sequence for its whole state. The two page sizes must be
equal, so vLLM grows the attention block until its page covers one layer's state, then pads the state page up
to the attention page (`Platform._align_hybrid_block_size`, `vllm/platforms/interface.py`, since
vllm-project/vllm#37467; earlier `HybridAttentionMambaModelConfig` in `vllm/model_executor/models/config.py`):

    block_size = a × ceil(state page / (a × attention bytes per token)),  a = max(kernel block size, block_size)

That rule holds without prefix caching and with `mamba_cache_mode="align"`. With `mamba_cache_mode="all"` vLLM
rounds to the Mamba chunk size instead, which kvlab does not model.

vLLM stores a state layer as a convolution window of `conv_kernel - 1` inputs in the model's dtype and the
recurrent state in `mamba_ssm_cache_dtype` (the model's dtype by default), where transformers keeps `conv_kernel`
inputs and a float32 state (`kvlab.specs.layers.FixedState`). So vLLM's state page is smaller than the
transformers cache that `kvlab.specs.sizing` counts. Chapter: *Paging* (book/07_paging).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.checks import check_count
from kvlab.specs.arch import UnsupportedConfigError
from kvlab.specs.layers import FixedState, FullAttention, NoCache, SlidingWindowAttention
from kvlab.specs.shape import prepare, shape
from kvlab.units import dtype_bytes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Attention backends on CUDA accept blocks in multiples of 16 tokens (the `a` of the rule at vLLM's default).
KERNEL_BLOCK_SIZE = 16


@dataclass(frozen=True)
class HybridPages:
    """One hybrid model's pages in vLLM's pool: attention blocks and state pages of one size."""

    attention_layers: int
    state_layers: int
    # One attention layer's K and V for one token, and one state layer's state, as vLLM stores them.
    attention_bytes_per_token: int
    state_bytes: int
    block_size: int

    @property
    def page_bytes(self) -> int:
        """The one page size: an attention block, and a padded state page."""
        return self.block_size * self.attention_bytes_per_token

    @property
    def padding_bytes(self) -> int:
        """Bytes a state page holds beyond the state."""
        return self.page_bytes - self.state_bytes

    @property
    def padding_percent(self) -> float:
        """The padding as vLLM logs it ("Padding mamba page size by X%"): a percentage of the state page."""
        return 100 * self.padding_bytes / self.state_bytes

    def pages(self, context: int) -> int:
        """Pages one sequence of `context` tokens holds: a block per started `block_size` tokens in every
        attention layer, and one page in every state layer."""
        check_count("context", context)
        return self.attention_layers * math.ceil(context / self.block_size) + self.state_layers

    def held_bytes(self, context: int) -> int:
        """Bytes of the pool one sequence of `context` tokens holds."""
        return self.pages(context) * self.page_bytes

    @property
    def group_size(self) -> int:
        """Layers per KV-cache group: the smaller of the two layer counts (vLLM groups each kind's layers in
        groups of this size; every group's blocks span one layer of each of `group_size` shared tensors)."""
        return min(self.attention_layers, self.state_layers)

    @property
    def groups(self) -> tuple[int, int]:
        """(attention groups, state groups): each kind's layers in groups of `group_size`, the last one padded."""
        size = self.group_size
        return math.ceil(self.attention_layers / size), math.ceil(self.state_layers / size)

    def num_blocks(self, available_bytes: int) -> int:
        """Blocks of the pool vLLM builds from `available_bytes` ("Available KV cache memory"): a block id holds
        one page in each of `group_size` tensors."""
        check_count("available_bytes", available_bytes)
        return available_bytes // (self.page_bytes * self.group_size)

    def pool_tokens(self, available_bytes: int) -> int:
        """vLLM's "GPU KV cache size: N tokens" for that memory: the blocks shared among all groups, in tokens."""
        return self.num_blocks(available_bytes) // sum(self.groups) * self.block_size

    def max_concurrency(self, available_bytes: int, max_model_len: int) -> float:
        """vLLM's "Maximum concurrency for N tokens per request": the pool's blocks over one full-length request's
        blocks (one per started block in each attention group, one in each state group)."""
        attention_groups, state_groups = self.groups
        per_request = attention_groups * math.ceil(max_model_len / self.block_size) + state_groups
        return self.num_blocks(available_bytes) / per_request

    def needed_bytes(self, context: int) -> int:
        """Bytes its K, V and state fill: what pages of one token and unpadded states would hold."""
        check_count("context", context)
        attention = self.attention_layers * context * self.attention_bytes_per_token
        return attention + self.state_layers * self.state_bytes


def vllm_state_bytes(
    layer: FixedState, dtype: str = "bf16", ssm_dtype: str | None = None, tp: int = 1
) -> int:
    """One state layer's page before padding on one of `tp` ranks, as vLLM stores it: `conv_kernel - 1` inputs
    of the convolution in `dtype`, and the recurrent state in `ssm_dtype` (vLLM's `mamba_ssm_cache_dtype`;
    None is `dtype`). Tensor parallelism splits the convolution's channels and the state's heads."""
    check_count("tp", tp)
    heads = layer.recurrent_shape[0] if layer.recurrent_shape else tp
    if layer.conv_channels % tp or heads % tp:
        raise ValueError(
            f"tensor-parallel size {tp} does not divide the state's {layer.conv_channels} convolution channels "
            f"and {heads} heads"
        )
    conv = layer.conv_channels // tp * (layer.conv_kernel - 1) * dtype_bytes(dtype)
    return conv + layer.recurrent_elements // tp * dtype_bytes(ssm_dtype or dtype)


def hybrid_pages(
    config: PretrainedConfig | str,
    dtype: str = "bf16",
    *,
    block_size: int = 16,
    kernel_block_size: int = KERNEL_BLOCK_SIZE,
    ssm_dtype: str | None = None,
    tp: int = 1,
) -> HybridPages:
    """vLLM's pages on one of `tp` tensor-parallel ranks for a hybrid of full-attention and state layers (a
    registry name or a config).

    `block_size` is the one asked for (vLLM's `--block-size`, 16 by default): vLLM keeps it when it already
    covers a state page. A model without state layers, or with sliding-window or MLA layers beside its state,
    or attention layers of two shapes, is an `UnsupportedConfigError`: vLLM then builds more than one
    attention group, which this rule does not cover."""
    check_count("block_size", block_size)
    check_count("kernel_block_size", kernel_block_size)
    spec = shape(prepare(config)).spec
    states = [layer for layer in spec.layers if isinstance(layer, FixedState)]
    attention = [layer for layer in spec.layers if isinstance(layer, FullAttention)]
    if not states:
        raise UnsupportedConfigError(
            f"{config if isinstance(config, str) else spec.model_type}: no state layer"
        )
    others = [
        layer.kind
        for layer in spec.layers
        if isinstance(layer, SlidingWindowAttention)
        or not isinstance(layer, FixedState | FullAttention | NoCache)
    ]
    per_token = {layer.elements_per_token_per_rank(tp) * dtype_bytes(dtype) for layer in attention}
    state_pages = {vllm_state_bytes(layer, dtype, ssm_dtype, tp) for layer in states}
    if others or len(per_token) != 1 or len(state_pages) != 1:
        raise UnsupportedConfigError(
            "vLLM's page alignment is modelled for one shape of full attention beside one shape of state; "
            f"this model has {', '.join(f'{n} {k}' for k, n in spec.kinds.items())}"
        )
    (token_bytes,) = per_token
    (state_bytes,) = state_pages
    return HybridPages(
        attention_layers=len(attention),
        state_layers=len(states),
        attention_bytes_per_token=token_bytes,
        state_bytes=state_bytes,
        block_size=aligned_block_size(state_bytes, token_bytes, block_size, kernel_block_size),
    )


def aligned_block_size(
    state_bytes: int, token_bytes: int, block_size: int = 16, kernel_block_size: int = KERNEL_BLOCK_SIZE
) -> int:
    """The attention block vLLM settles on: `block_size` when its page already holds `state_bytes`, else the
    smallest multiple of max(`kernel_block_size`, `block_size`) whose page of `token_bytes` a token does."""
    for name, value in (("state_bytes", state_bytes), ("token_bytes", token_bytes)):
        check_count(name, value)
    alignment = max(kernel_block_size, block_size)
    return max(block_size, alignment * math.ceil(state_bytes / (alignment * token_bytes)))
