"""Layer kinds and what each one caches, attends to and computes, in one place.

Every decoder layer is one of six kinds, mapped from transformers' `layer_types` the way transformers 5.24 maps a
layer type to its cache-layer class (`cache_utils.DYNAMIC_LAYER_TYPE_MAPPING`):

- `FullAttention`: K and V per KV head for every past token (`DynamicLayer`);
- `SlidingWindowAttention`: the same, but only the last `window - 1` tokens are kept (`DynamicSlidingWindowLayer`:
  the next query is the window's last position) and a query attends to at most `window` keys;
- `MLAttention`: DeepSeek's multi-head latent attention; the cache holds one `kv_lora_rank` latent plus the
  decoupled rotary key per token, shared by all heads (DeepSeek-AI, 2024, arXiv:2405.04434, §2.1), and for
  DeepSeek-V3.2's sparse attention an indexer key beside them (`DynamicIndexedLayer`);
- `StateLayer`: a layer with no attention that keeps a fixed-size state per sequence instead (`LinearAttentionLayer`):
  the last `conv_kernel` inputs of a causal convolution, and for Mamba, Mamba-2 and gated DeltaNet a recurrent
  (SSM) state; neither grows with the tokens;
- `HybridLayer`: attention and such a state in one layer (`LinearAttentionAndFullAttentionLayer`: Falcon-H1's
  parallel attention and Mamba-2 mixer, Zamba2's shared attention block in front of its Mamba-2 mixer);
- `NoCache`: layers that keep nothing (`DummyLayer`: MLP- or MoE-only layers, KV-sharing consumers).

Only `FullAttention` and the attention of `HybridLayer` grow with the context; `state_bytes(dtype)` is the fixed
part one sequence holds once it has seen a token (`kvlab.specs.sizing.state_bytes_per_sequence`).

Under tensor parallelism (`tp` ranks) a layer says what one rank keeps: `kv_heads_per_rank`, with vLLM's
replication past the KV-head count, and MLA's latent whole on every rank. Sizing (`kvlab.specs.sizing`), the roofline (`kvlab.costs.roofline`) and timing (`kvlab.experiments.timing`) ask the layer, never its
kind's name, so a new kind is one class here. Chapters: *Sizing the cache*, *Why decode is bandwidth-bound*.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from kvlab.checks import check_count
from kvlab.units import dtype_bytes

if TYPE_CHECKING:
    import torch

LayerKind = Literal["full", "sliding", "mla", "state", "hybrid", "none"]

# The dtype transformers 5.24 keeps every recurrent (SSM / delta-rule) state in, whatever the model's dtype: each
# scan computes in float32 and `LinearAttentionLayer.lazy_initialization` (cache_utils.py) allocates the cached
# state `zeros_like` the scan's float32 result. Mamba: `mamba_selective_scan` (models/mamba/modeling_mamba.py,
# discretised A and B in float32); Jamba likewise (models/jamba/modeling_jamba.py); Mamba-2 and its hybrids:
# `mamba2_chunk_scan` casts its inputs `.float()` (models/mamba2, bamba, granitemoehybrid, nemotron_h, falcon_h1,
# zamba2: modeling_*.py); gated DeltaNet: `torch_chunk_gated_delta_rule` casts to float32
# (models/qwen3_next/modeling_qwen3_next.py). The conv state keeps the activations' dtype. Checked on the cache
# objects in fp32 and bf16 by tests/test_state_sizing.py.
RECURRENT_STATE_DTYPE = "float32"


def _check_tp(tp: int) -> None:
    check_count("tensor-parallel size", tp)


@dataclass(frozen=True)
class LayerSpec(ABC):
    """What one layer of one sequence caches per token, and the attention work it does."""

    kind: ClassVar[LayerKind]

    @property
    @abstractmethod
    def elements_per_token(self) -> int:
        """Elements this layer stores per token, in the form transformers caches."""

    @property
    def expanded_elements_per_token(self) -> int:
        """Elements per token if K and V were stored per head (for MLA: what its latent replaces)."""
        return self.elements_per_token

    @property
    def cache_heads(self) -> int:
        """KV heads this layer caches (MLA's single shared latent counts as one)."""
        return 0

    @property
    def cached_shape(self) -> str:
        """What one token adds to this layer, as the sizing table writes it ("" where it caches nothing)."""
        return ""

    @property
    def key_dim(self) -> int:
        """Width of one head's key as the scores use it (0 where the layer has no attention)."""
        return 0

    def state_bytes(self, dtype: torch.dtype | str) -> int:
        """Bytes of the fixed-size state one sequence keeps in this layer (0 where it keeps none)."""
        return 0

    @property
    def state_shape(self) -> str:
        """The fixed state one sequence keeps, as the sizing table writes it ("" where it keeps none)."""
        return ""

    def kv_bytes_per_token(self, dtype: torch.dtype | str) -> int:
        """Bytes one more token adds to this layer while it still grows."""
        return self.elements_per_token * dtype_bytes(dtype)

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one of `tp` tensor-parallel ranks caches (see `FullAttention`; MLA's latent counts as one)."""
        _check_tp(tp)
        return self.cache_heads

    def elements_per_token_per_rank(self, tp: int) -> int:
        """Elements one of `tp` tensor-parallel ranks stores per token for this layer."""
        _check_tp(tp)
        return self.elements_per_token

    def replicas(self, tp: int) -> int:
        """How many of the `tp` ranks hold a copy of each cached head (1: the cache is split, not copied)."""
        _check_tp(tp)
        return 1

    @property
    def max_cached_tokens(self) -> int | None:
        """Tokens this layer holds at most per sequence; None where it grows with the context."""
        return None

    def cached_tokens(self, context: int) -> int:
        """Tokens this layer holds after a forward over `context` tokens (transformers' `DynamicCache` rules)."""
        cap = self.max_cached_tokens
        return context if cap is None else min(context, cap)

    def unread_elements(self, context: int) -> int:
        """Cached elements a decode step at `context` tokens does not read (0: it reads all it holds)."""
        return 0

    def attended(self, context: float) -> float:
        """Keys one query attends to when the sequence is `context` tokens long, counting itself."""
        return context

    @property
    @abstractmethod
    def pair_flops_per_head(self) -> int:
        """FLOPs of one query against one key in one head: the q·k score plus the weighted sum of v."""

    def attention_flops(self, context: float, num_heads: int) -> float:
        """FLOPs of one query token's attention when the sequence is `context` tokens long, all heads."""
        return num_heads * self.pair_flops_per_head * self.attended(context)

    def prefill_attention_flops(self, prompt_len: int, num_heads: int) -> float:
        """FLOPs of causal attention over a prompt: token i (1-based) attends to `attended(i)` keys."""
        return num_heads * self.pair_flops_per_head * self.prefill_pairs(prompt_len)

    def prefill_pairs(self, prompt_len: int) -> float:
        """Query-key pairs of a causal prefill, summed over the triangle."""
        return prompt_len * (prompt_len + 1) / 2


@dataclass(frozen=True)
class FullAttention(LayerSpec):
    kind: ClassVar[LayerKind] = "full"
    kv_heads: int
    head_dim: int  # of K
    v_head_dim: int  # of V

    @property
    def elements_per_token(self) -> int:
        return self.kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def cache_heads(self) -> int:
        return self.kv_heads

    @property
    def cached_shape(self) -> str:
        if self.head_dim == self.v_head_dim:
            return f"2 × {self.kv_heads} × {self.head_dim}"
        return f"{self.kv_heads} × ({self.head_dim} + {self.v_head_dim})"

    @property
    def key_dim(self) -> int:
        return self.head_dim

    @property
    def pair_flops_per_head(self) -> int:
        return 2 * (self.head_dim + self.v_head_dim)

    def kv_heads_per_rank(self, tp: int) -> int:
        """vLLM's rule (`QKVParallelLinear`, `ModelConfig.get_num_kv_heads`): `max(1, kv_heads // tp)`.

        Up to `kv_heads` ranks split the heads; past that each rank holds one head and every head is copied on
        `tp // kv_heads` ranks. Either way one must divide the other, as vLLM requires.
        """
        _check_tp(tp)
        if (tp <= self.kv_heads and self.kv_heads % tp) or (tp > self.kv_heads and tp % self.kv_heads):
            raise ValueError(
                f"tensor-parallel size {tp} and the {self.kv_heads} KV heads must divide one another"
            )
        return max(1, self.kv_heads // tp)

    def elements_per_token_per_rank(self, tp: int) -> int:
        return self.kv_heads_per_rank(tp) * (self.head_dim + self.v_head_dim)

    def replicas(self, tp: int) -> int:
        return tp * self.kv_heads_per_rank(tp) // self.kv_heads


@dataclass(frozen=True)
class SlidingWindowAttention(FullAttention):
    kind: ClassVar[LayerKind] = "sliding"
    window: int  # attention window in tokens, the query included

    def __post_init__(self) -> None:
        # transformers slices [-window + 1:], which keeps everything when window == 1.
        check_count("a sliding window", self.window, 2)

    @property
    def max_cached_tokens(self) -> int:
        return self.window - 1

    def attended(self, context: float) -> float:
        return min(context, self.window)

    def prefill_pairs(self, prompt_len: int) -> float:
        w = min(self.window, prompt_len)
        return w * (w + 1) / 2 + (prompt_len - w) * w  # the ramp up to the window, then full windows


@dataclass(frozen=True)
class MLAttention(LayerSpec):
    """Multi-head latent attention; with `index_dim`, DeepSeek-V3.2's sparse attention (DSA): a lightning indexer
    keeps one `index_dim`-wide key per token beside the latent (transformers' `DynamicIndexedLayer`, a
    `[batch, seq_len, index_head_dim]` tensor), scores every past token with `index_heads` small heads, and the
    latent attention reads only the `index_topk` best (DeepSeek-AI, 2025, DeepSeek-V3.2-Exp, "DeepSeek Sparse
    Attention"; https://github.com/deepseek-ai/DeepSeek-V3.2-Exp)."""

    kind: ClassVar[LayerKind] = "mla"
    num_heads: int
    qk_head_dim: int  # nope + rope part of each head's key, after up-projection
    v_head_dim: int
    latent_dim: int  # kv_lora_rank, stored instead of per-head K and V
    rope_dim: int  # the decoupled rotary key, stored beside the latent
    index_dim: int = 0
    index_heads: int = 0
    # Tokens the latent attention reads once the context is longer; None: every token (plain MLA)
    index_topk: int | None = None

    @property
    def elements_per_token(self) -> int:
        return self.latent_dim + self.rope_dim + self.index_dim

    @property
    def expanded_elements_per_token(self) -> int:
        return self.num_heads * (self.qk_head_dim + self.v_head_dim) + self.index_dim

    @property
    def cache_heads(self) -> int:
        return 1

    @property
    def cached_shape(self) -> str:
        indexer = f" + indexer key {self.index_dim}" if self.index_dim else ""
        return f"latent {self.latent_dim} + rope {self.rope_dim}{indexer}"

    def attended(self, context: float) -> float:
        return context if self.index_topk is None else min(context, self.index_topk)

    def unread_elements(self, context: int) -> int:
        # the latent and rope of the tokens the indexer leaves out; their indexer keys are still read
        return (self.latent_dim + self.rope_dim) * max(
            0, self.cached_tokens(context) - int(self.attended(context))
        )

    def attention_flops(self, context: float, num_heads: int) -> float:
        # the indexer scores every past token (q.k per index head), the latent attention only the top-k
        return super().attention_flops(context, num_heads) + self.index_heads * 2 * self.index_dim * context

    def prefill_pairs(self, prompt_len: int) -> float:
        if self.index_topk is None:
            return super().prefill_pairs(prompt_len)
        w = min(self.index_topk, prompt_len)
        return w * (w + 1) / 2 + (prompt_len - w) * w

    def prefill_attention_flops(self, prompt_len: int, num_heads: int) -> float:
        indexer = self.index_heads * 2 * self.index_dim * prompt_len * (prompt_len + 1) / 2
        return super().prefill_attention_flops(prompt_len, num_heads) + indexer

    def replicas(self, tp: int) -> int:
        """Every rank keeps the whole latent (vLLM's MLA, without decode context parallelism): `tp` copies."""
        _check_tp(tp)
        return tp

    @property
    def key_dim(self) -> int:
        return self.qk_head_dim

    @property
    def pair_flops_per_head(self) -> int:
        # Absorbed form, as serving engines run it: score against latent + rope, values from the latent.
        return 2 * (self.latent_dim + self.rope_dim + self.latent_dim)


@dataclass(frozen=True)
class NoCache(LayerSpec):
    kind: ClassVar[LayerKind] = "none"

    @property
    def elements_per_token(self) -> int:
        return 0

    @property
    def max_cached_tokens(self) -> int:
        return 0

    def attended(self, context: float) -> float:
        return 0.0

    def kv_heads_per_rank(self, tp: int) -> int:
        _check_tp(tp)
        return 0

    @property
    def pair_flops_per_head(self) -> int:
        return 0


@dataclass(frozen=True)
class FixedState(LayerSpec):
    """The fixed-size state of a linear-attention, Mamba or convolution layer, per sequence.

    transformers 5.24 keeps it in a `LinearAttentionLayer` (cache_utils.py): `conv_states[0]` of shape
    `(batch, conv_channels, conv_kernel)` in the activations' dtype (a prompt shorter than the kernel is padded,
    a longer one cut to its last `conv_kernel` inputs), and `recurrent_states[0]` of shape
    `(batch, *recurrent_shape)` in float32 (`RECURRENT_STATE_DTYPE`). A layer with only a convolution (LFM2's
    short conv) has `recurrent_shape == ()` and no recurrent state at all.
    """

    conv_channels: int
    conv_kernel: int
    recurrent_shape: tuple[int, ...]  # () where the layer keeps no recurrent state

    def __post_init__(self) -> None:
        # Stored shapes come back from JSON as lists; keep the dataclass hashable.
        object.__setattr__(self, "recurrent_shape", tuple(self.recurrent_shape))
        check_count("conv_channels", self.conv_channels)
        check_count("conv_kernel", self.conv_kernel)
        for size in self.recurrent_shape:
            check_count("a recurrent state dimension", size)

    @property
    def recurrent_elements(self) -> int:
        """Elements of the recurrent state per sequence (0 without one)."""
        return math.prod(self.recurrent_shape) if self.recurrent_shape else 0

    def state_bytes(self, dtype: torch.dtype | str) -> int:
        conv = self.conv_channels * self.conv_kernel * dtype_bytes(dtype)
        return conv + self.recurrent_elements * dtype_bytes(RECURRENT_STATE_DTYPE)

    @property
    def state_shape(self) -> str:
        conv = f"conv {self.conv_channels} × {self.conv_kernel}"
        if not self.recurrent_shape:
            return conv
        return conv + " + state " + " × ".join(map(str, self.recurrent_shape)) + " (fp32)"


@dataclass(frozen=True)
class StateLayer(FixedState, NoCache):
    """A layer without attention that keeps only a fixed-size state (Mamba, Mamba-2, gated DeltaNet, short conv)."""

    kind: ClassVar[LayerKind] = "state"


@dataclass(frozen=True)
class HybridLayer(FixedState, FullAttention):
    """Full attention and a fixed-size state in one layer (`LinearAttentionAndFullAttentionLayer`)."""

    kind: ClassVar[LayerKind] = "hybrid"
