"""Caches that keep fewer tokens: KV eviction policies as transformers cache layers, with exact stored bytes.

`make_cache(policy, model, **options)` returns a `transformers.Cache` whose full-attention layers keep only some
of the tokens they have seen; `model(ids, cache=cache)` and `model.generate(ids, cache=cache)` use it like a
`DynamicCache`. Four policies:

- ``"uniform"``: a baseline that keeps ``ceil(keep_ratio × n)`` evenly spaced tokens of each n-token prefill;
- ``"streaming"``: StreamingLLM's attention sinks and recent window (Xiao et al., 2023, arXiv:2309.17453): the
  first ``sinks`` tokens and the last ``window`` ones, after every step;
- ``"snapkv"``: SnapKV (Li et al., 2024, arXiv:2404.14469): at each prefill, the last ``window`` prompt tokens'
  queries score the earlier keys (attention averaged over those queries and over the query heads that share a KV
  head, smoothed by a max-pool of width ``kernel``); each KV head keeps its highest-scoring keys and the window,
  ``ceil(keep_ratio × n)`` in all;
- ``"h2o"``: H2O's heavy hitters (Zhang et al., 2023, arXiv:2306.14048): every key accumulates the attention it
  receives; after each step a KV head keeps ``ceil(keep_ratio × seen)`` keys, half of them the most recent and the
  rest the heaviest hitters.

Tokens generated after a prefill are kept by "uniform" and "snapkv" (they compress prompts, as kvpress's presses
do), evicted by "streaming" and "h2o". Keys keep the rotary position they were written with. The layer reports
every token it has seen as its sequence length, so new tokens get their true positions, and shows the attention
mask its kept keys as the ones just before the new tokens. That is exact for a batch without padding (one prompt,
or prompts of one length); a padded batch's padding mask would be read at the wrong positions. SnapKV and H2O need the queries: `make_cache` hooks the model's attention modules (Llama-style
`q_proj`, optional `q_norm`, rotary embedding), and the hook hands each forward's hidden states to the cache it is
called with. `kvlab.experiments.quant.accuracy` and `compare_shrinks` score these caches beside the quantized ones.

NVIDIA's kvpress packages such policies as "presses", but its latest release on PyPI (0.5.5) requires
transformers<5.3 and kvlab pins 5.24, so it is not installed and no peer check against it runs here.
Chapter: *Keeping fewer tokens*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs
from transformers.models.llama.modeling_llama import rotate_half

from kvlab.specs.sizing import evicted_context

POLICIES = ("uniform", "streaming", "snapkv", "h2o")
_HOOKED = "_kvlab_evict_hooked"


@dataclass
class Queries:
    """What one attention call's hook saw: the module and its input, to rebuild the queries from."""

    # An attention module: q_proj, head_dim, scaling and perhaps q_norm, read by name
    module: Any
    hidden_states: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]

    def rows(self, last: int | None = None) -> torch.Tensor:
        """Rotated queries `(batch, heads, rows, head_dim)` of the last `last` tokens (all when None), as the
        module computes them."""
        hidden = self.hidden_states if last is None else self.hidden_states[:, -last:]
        module = self.module
        q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)
        if getattr(module, "q_norm", None) is not None:
            q = module.q_norm(q)
        q = q.transpose(1, 2)
        cos, sin = self.position_embeddings
        if last is not None:
            cos, sin = cos[:, -last:], sin[:, -last:]
        return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)


def attention_weights(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, causal_end: int
) -> torch.Tensor:
    """Softmax attention `(batch, kv_heads, rows, keys)` of query rows over `keys`, summed over the query heads that
    share a KV head. Row i is the token at position `causal_end - rows + i` of the keys and sees keys up to it."""
    b, heads, rows, d = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.float().reshape(b, kv_heads, heads // kv_heads * rows, d)
    scores = grouped @ keys.float().transpose(-1, -2) * scaling
    position = torch.arange(causal_end - rows, causal_end, device=keys.device).repeat(heads // kv_heads)
    scores.masked_fill_(torch.arange(keys.shape[-2], device=keys.device) > position[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights.view(b, kv_heads, heads // kv_heads, rows, -1).sum(dim=2)


class EvictingLayer(DynamicLayer):
    """A full-attention cache layer that keeps some of its tokens; subclasses choose which.

    `update` returns every kept key plus the new ones (what the mask announced), then stores the chosen subset.
    Every KV head keeps the same number of tokens, possibly different ones.
    """

    policy = "base"
    is_croppable = False
    needs_queries = False

    def __init__(self, keep_ratio: float = 1.0) -> None:
        super().__init__()
        if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, int | float) or not 0 < keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
        self.keep_ratio = float(keep_ratio)
        self.cumulative_length = 0
        # Position of each kept token, per batch row and KV head: (batch, kv_heads, kept)
        self.positions = torch.empty(0, dtype=torch.long)
        self.queries: Queries | None = None

    def budget(self, tokens: int) -> int:
        """Tokens kept out of `tokens`: ceil(keep_ratio × tokens), at least one."""
        return evicted_context(tokens, self.keep_ratio)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            b, kv_heads = key_states.shape[:2]
            self.positions = torch.empty(b, kv_heads, 0, dtype=torch.long, device=key_states.device)
        new = key_states.shape[-2]
        new_positions = torch.arange(self.cumulative_length, self.cumulative_length + new, device=self.device)
        assert self.keys is not None and self.values is not None
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        positions = torch.cat([self.positions, new_positions.expand(*key_states.shape[:2], new)], dim=-1)
        self.cumulative_length += new
        keep = self.select(keys, positions, new)
        if keep is None:
            self.keys, self.values, self.positions = keys, values, positions
        else:
            index = keep.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
            self.keys = keys.gather(2, index)
            self.values = values.gather(2, index)
            self.positions = positions.gather(2, keep)
        self.queries = None
        return keys, values

    def select(self, keys: torch.Tensor, positions: torch.Tensor, new: int) -> torch.Tensor | None:
        """Indices `(batch, kv_heads, kept)` into this step's keys to store, in order; None keeps them all."""
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        keys = self.keys
        stored = keys.shape[-2] if self.is_initialized and keys is not None and keys.dim() == 4 else 0
        return stored + query_length, self.cumulative_length - stored

    def reset(self) -> None:
        self.cumulative_length = 0
        self.positions = torch.empty(0, dtype=torch.long)
        super().reset()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("an evicting cache does not support beam search")


def _ordered(index: torch.Tensor) -> torch.Tensor:
    return index.sort(dim=-1).values


class UniformLayer(EvictingLayer):
    """Evenly spaced tokens of every prefill (the first and the last always among them)."""

    policy = "uniform"

    def select(self, keys: torch.Tensor, positions: torch.Tensor, new: int) -> torch.Tensor | None:
        if new == 1:
            return None
        old = keys.shape[-2] - new
        keep = self.budget(new)
        if keep == new:
            return None
        chosen = torch.linspace(0, new - 1, keep, device=keys.device).round().long() + old
        index = torch.cat([torch.arange(old, device=keys.device), chosen])
        return index.expand(*keys.shape[:2], -1)


class StreamingLayer(EvictingLayer):
    """StreamingLLM: the first `sinks` tokens and the last `window`."""

    policy = "streaming"

    def __init__(self, sinks: int = 4, window: int = 256) -> None:
        super().__init__()
        for name, value in (("sinks", sinks), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "sinks" else 1):
                raise ValueError(f"{name} must be an integer >= {0 if name == 'sinks' else 1}, got {value!r}")
        self.sinks, self.window = sinks, window

    def select(self, keys: torch.Tensor, positions: torch.Tensor, new: int) -> torch.Tensor | None:
        n = keys.shape[-2]
        if n <= self.sinks + self.window:
            return None
        index = torch.cat(
            [
                torch.arange(self.sinks, device=keys.device),
                torch.arange(n - self.window, n, device=keys.device),
            ]
        )
        return index.expand(*keys.shape[:2], -1)


class SnapKVLayer(EvictingLayer):
    """SnapKV: the observation window's attention picks each KV head's prompt keys."""

    policy = "snapkv"
    needs_queries = True

    def __init__(self, keep_ratio: float = 0.5, window: int = 32, kernel: int = 7) -> None:
        super().__init__(keep_ratio)
        for name, value in (("window", window), ("kernel", kernel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (a centred pool), got {kernel}")
        self.window, self.kernel = window, kernel

    def select(self, keys: torch.Tensor, positions: torch.Tensor, new: int) -> torch.Tensor | None:
        keep = self.budget(new)
        if new == 1 or keep >= new:
            return None
        if keep < self.window:
            raise ValueError(
                f"SnapKV keeps its {self.window}-token observation window: keep_ratio {self.keep_ratio} of "
                f"{new} tokens keeps {keep}"
            )
        if self.queries is None:
            raise RuntimeError("SnapKV needs the queries: build the cache with make_cache(policy, model)")
        old = keys.shape[-2] - new
        scaling = self.queries.module.scaling
        weights = attention_weights(self.queries.rows(self.window), keys, scaling, keys.shape[-2])
        # Keys of this prefill before the window, scored by the window's mean attention, smoothed
        scores = weights[..., old : keys.shape[-2] - self.window].mean(dim=-2)
        scores = torch.nn.functional.max_pool1d(
            scores.flatten(0, 1)[:, None], self.kernel, stride=1, padding=self.kernel // 2
        ).view_as(scores)
        top = scores.topk(keep - self.window, dim=-1).indices + old
        shape = (*keys.shape[:2], -1)
        rest = torch.arange(keys.shape[-2] - self.window, keys.shape[-2], device=keys.device).expand(shape)
        earlier = torch.arange(old, device=keys.device).expand(shape)
        return torch.cat([earlier, _ordered(top), rest], dim=-1)


class H2OLayer(EvictingLayer):
    """H2O: accumulated attention picks the heavy hitters; half the budget goes to the most recent tokens."""

    policy = "h2o"
    needs_queries = True

    def __init__(self, keep_ratio: float = 0.5) -> None:
        super().__init__(keep_ratio)
        self.scores = torch.empty(0)

    def select(self, keys: torch.Tensor, positions: torch.Tensor, new: int) -> torch.Tensor | None:
        if self.queries is None:
            raise RuntimeError("H2O needs the queries: build the cache with make_cache(policy, model)")
        n = keys.shape[-2]
        weights = attention_weights(self.queries.rows(), keys, self.queries.module.scaling, n).sum(dim=-2)
        old = self.scores if self.scores.numel() else weights.new_zeros(*keys.shape[:2], 0)
        self.scores = torch.cat([old, weights.new_zeros(*keys.shape[:2], new)], dim=-1) + weights
        keep = self.budget(self.cumulative_length)
        if keep >= n:
            return None
        recent = keep // 2
        heavy = self.scores[..., : n - recent].topk(keep - recent, dim=-1).indices
        tail = torch.arange(n - recent, n, device=keys.device).expand(*keys.shape[:2], -1)
        index = torch.cat([_ordered(heavy), tail], dim=-1)
        self.scores = self.scores.gather(2, index)
        return index

    def reset(self) -> None:
        self.scores = torch.empty(0)
        super().reset()


LAYERS: dict[str, type[EvictingLayer]] = {
    cls.policy: cls for cls in (UniformLayer, StreamingLayer, SnapKVLayer, H2OLayer)
}


class EvictingCache(Cache):
    """A `Cache` of evicting layers: the query hook hands hidden states to these caches only."""


def _hand_queries(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, EvictingCache):
        return
    layer = cache.layers[module.layer_idx]  # type: ignore[index]
    if isinstance(layer, EvictingLayer) and layer.needs_queries:
        hidden = args[0] if args else kwargs["hidden_states"]
        layer.queries = Queries(module, hidden, kwargs["position_embeddings"])


def hook_queries(model: PreTrainedModel) -> None:
    """Let SnapKV and H2O layers see their attention module's queries (once per model; a no-op for other caches)."""
    if getattr(model, _HOOKED, False):
        return
    modules = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no Llama-style attention modules (q_proj) to read queries from"
        )
    for module in modules:
        module.register_forward_pre_hook(_hand_queries, with_kwargs=True)
    setattr(model, _HOOKED, True)


def make_cache(policy: str, model: PreTrainedModel, **options: Any) -> EvictingCache:
    """A cache for `model` whose full-attention layers keep tokens per `policy` (see the module docstring).

    `options`: ``keep_ratio`` (uniform, snapkv, h2o), ``sinks`` and ``window`` (streaming), ``window`` and
    ``kernel`` (snapkv). A model with sliding-window or state layers is refused.
    """
    if policy not in LAYERS:
        raise ValueError(f"unknown eviction policy {policy!r}; known policies: {', '.join(POLICIES)}")
    layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    other = sorted({kind for kind in layer_types if kind != "full_attention"})
    if other:
        raise ValueError(
            f"eviction is applied to full-attention layers only; this model has {', '.join(other)}"
        )
    try:
        layers: list[Any] = [LAYERS[policy](**options) for _ in layer_types]
    except TypeError:
        raise ValueError(f"policy {policy!r} takes no option among {sorted(options)}") from None
    if layers[0].needs_queries:
        hook_queries(model)
    return EvictingCache(layers=layers)


def kept_tokens(policy: str, prompt: int, generated: int = 0, **options: Any) -> int:
    """Tokens each layer keeps after a `prompt`-token prefill and `generated` one-token steps (the count
    `stored_bytes` follows), without running a model: `kvlab.specs.sizing.evicted_context`'s rule."""
    layer = LAYERS[policy](**options) if policy in LAYERS else None
    if layer is None:
        raise ValueError(f"unknown eviction policy {policy!r}; known policies: {', '.join(POLICIES)}")
    if isinstance(layer, StreamingLayer):
        return evicted_context(prompt + generated, sinks=layer.sinks, window=layer.window)
    if isinstance(layer, H2OLayer):
        return evicted_context(prompt + generated, layer.keep_ratio)
    return evicted_context(prompt, layer.keep_ratio) + generated


# The passkey task's filler, in kvlab's own words: sentences that carry nothing to remember.
PASSKEY_FILLER = "The river runs to the sea. Leaves fall in autumn. Birds sing at dawn. The road goes on. "


def passkey_prompt(tokenizer: Any, repeats: int, depth: float, key: str) -> torch.Tensor:
    """Token ids `(1, T)` of a passkey retrieval prompt (the task of Mohtashami and Jaggi, 2023,
    arXiv:2305.16300, worded anew): `key` stated twice after `round(depth × repeats)` of `repeats` filler
    sentences, then asked for, the answer left for the model to complete."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats must be an integer >= 0, got {repeats!r}")
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    before = round(repeats * depth)
    text = (
        "A number is hidden in the long text below. Remember it: you will be asked for it.\n"
        + PASSKEY_FILLER * before
        + f"The number to remember is {key}. Again, the number is {key}. "
        + PASSKEY_FILLER * (repeats - before)
        + "\nWhat is the number to remember? The number is"
    )
    return torch.tensor([tokenizer(text)["input_ids"]])


def retrieves(
    model: Any,
    tokenizer: Any,
    ids: torch.Tensor,
    key: str,
    policy: str | None = None,
    max_new_tokens: int = 6,
    **options: Any,
) -> bool:
    """Whether greedy decoding of `ids` with a `policy` cache (None: the full cache) writes `key` within
    `max_new_tokens` tokens."""
    cache = make_cache(policy, model, **options) if policy is not None else None
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            ids.to(device), cache=cache, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return key in tokenizer.decode(out[0, ids.shape[1] :])


def reusable_prefix_blocks(positions: torch.Tensor, block_size: int = 16) -> int:
    """Full blocks at the start of a sequence that a prefix cache could still serve after eviction.

    A prefix cache (chapter 9) keys each block by a hash of its tokens chained over every earlier block, and
    serves it only whole. After eviction a block is whole only if every one of its positions is kept, in every
    KV head; the first block with a dropped token ends the chain. `positions`: a layer's kept positions
    `(batch, kv_heads, kept)` or `(kept,)`.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    rows = positions.reshape(-1, positions.shape[-1])
    leading = []
    for row in rows.tolist():
        # Kept positions are in order: the prefix is whole up to the first gap
        n = 0
        while n < len(row) and row[n] == n:
            n += 1
        leading.append(n)
    return min(leading) // block_size
