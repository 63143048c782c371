"""Layer kinds and what each one caches, attends to and computes, in one place.

Every decoder layer is one of four kinds, mapped from transformers' `layer_types` the way transformers maps a
layer type to its cache-layer class (`cache_utils.LAYER_CLASS_MAP`):

- `FullAttention`: K and V per KV head for every past token (`DynamicLayer`);
- `SlidingWindowAttention`: the same, but only the last `window - 1` tokens are kept (`DynamicSlidingWindowLayer`:
  the next query is the window's last position) and a query attends to at most `window` keys;
- `MLAttention`: DeepSeek's multi-head latent attention; the cache holds one `kv_lora_rank` latent plus the
  decoupled rotary key per token, shared by all heads (DeepSeek-AI, 2024, arXiv:2405.04434, §2.1);
- `NoCache`: layers that keep no per-token K/V (linear attention, Mamba, convolution, dummy layers).

Under tensor parallelism (`tp` ranks) a layer says what one rank keeps: `kv_heads_per_rank`, with vLLM's
replication past the KV-head count, and MLA's latent whole on every rank. Sizing (`kvlab.specs.sizing`), the roofline (`kvlab.costs.roofline`) and timing (`kvlab.experiments.timing`) ask the layer, never its
kind's name, so a new kind is one class here. Chapters: *Sizing the cache*, *Why decode is bandwidth-bound*.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from kvlab.checks import check_count
from kvlab.units import dtype_bytes

if TYPE_CHECKING:
    import torch

LayerKind = Literal["full", "sliding", "mla", "none"]


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
    kind: ClassVar[LayerKind] = "mla"
    num_heads: int
    qk_head_dim: int  # nope + rope part of each head's key, after up-projection
    v_head_dim: int
    latent_dim: int  # kv_lora_rank, stored instead of per-head K and V
    rope_dim: int  # the decoupled rotary key, stored beside the latent

    @property
    def elements_per_token(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def expanded_elements_per_token(self) -> int:
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def cache_heads(self) -> int:
        return 1

    @property
    def cached_shape(self) -> str:
        return f"latent {self.latent_dim} + rope {self.rope_dim}"

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
