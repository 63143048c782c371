"""Paged KV storage and the attention that reads through block tables.

Every layer owns a pool of fixed-size blocks, `num_blocks × block_size × kv_heads × head_dim`, for K and for V. A
sequence's cache is a list of block ids (its block table); token `i` of a sequence lives in block
`table[i // block_size]` at offset `i % block_size`, i.e. in slot `block * block_size + offset` of the pool.

How the model runs on it (the design of nano-vllm): all tokens a step schedules, from every sequence, are
flattened into one batch row and passed with their `position_ids`. `paged_attention_forward` is registered with
transformers' `AttentionInterface` as ``"kvlab_paged"``; a model whose `config._attn_implementation` names it
(see `use_paged_attention`) calls it in every attention layer with that layer's fresh Q, K and V (RoPE applied).
It writes K and V into the layer's pool through the step's slot mapping, then attends each sequence's queries to
its whole context read back through its block table. The per-step `PagedContext` (slot mapping, block tables,
context lengths, query offsets) travels as a keyword argument of the model's forward, which transformers passes
down to the attention function; `module.layer_idx` selects the layer's pool. No causal mask is built by the model:
transformers skips mask creation for attention implementations it has no mask function for, and the context
carries the masks instead (causal within the context, plus a sliding window when the layer has one).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from kvlab.arch import describe

ATTN_IMPLEMENTATION = "kvlab_paged"


@dataclass(frozen=True)
class KVShape:
    """What one block of one layer holds: `block_size` tokens of `kv_heads × head_dim` for K and again for V."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> KVShape:
        spec = describe(config)
        if any(layer.kind not in ("full", "sliding") for layer in spec.layers):
            raise ValueError(
                f"{spec.model_type}: the paged cache supports per-head K/V layers only (not MLA)"
            )
        shapes = {(layer.kv_heads, layer.head_dim, layer.v_head_dim) for layer in spec.layers}
        if len(shapes) != 1 or next(iter(shapes))[1] != next(iter(shapes))[2]:
            raise ValueError(
                f"{spec.model_type}: layers must share one K/V shape to share a pool, got {shapes}"
            )
        kv_heads, head_dim, _ = shapes.pop()
        return cls(spec.num_layers, kv_heads, head_dim)


class KVPool:
    """The physical cache: one tensor `(layers, 2, num_blocks, block_size, kv_heads, head_dim)`, allocated once."""

    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        self.kv = torch.zeros(
            shape.num_layers,
            2,
            num_blocks,
            block_size,
            shape.kv_heads,
            shape.head_dim,
            dtype=dtype,
            device=device,
        )

    @staticmethod
    def bytes_per_token(shape: KVShape, dtype: torch.dtype) -> int:
        return shape.num_layers * 2 * shape.kv_heads * shape.head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools of one layer, each `(num_blocks, block_size, kv_heads, head_dim)`."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def write(self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `(tokens, kv_heads, head_dim)` K and V at flat slot indices `block * block_size + offset`."""
        k_pool, v_pool = self.layer(layer_idx)
        k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, key.to(k_pool.dtype))
        v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, value.to(v_pool.dtype))

    def gather(self, layer_idx: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `(seqs, max_blocks)` block tables as `(seqs, kv_heads, max_blocks * block_size, head_dim)`."""
        k_pool, v_pool = self.layer(layer_idx)
        seqs = block_tables.shape[0]

        def read(pool: torch.Tensor) -> torch.Tensor:
            # index_select on whole blocks is the cheapest gather on CPU (one memcpy per block).
            rows = pool.view(pool.shape[0], -1).index_select(0, block_tables.reshape(-1))
            return rows.view(seqs, -1, *pool.shape[2:]).transpose(1, 2)

        return read(k_pool), read(v_pool)


def slots_for(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat pool slots of token positions `start..end-1` of a sequence with this block table."""
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


@dataclass
class PagedContext:
    """What one forward step needs to read and write the pool; built once per step, shared by all layers.

    The step's tokens are flat: sequence `i` owns `query_lens[i]` consecutive tokens, which are the last tokens of
    its context of `context_lens[i]` tokens (context includes them). Decode sequences (one query token) are batched
    into one padded attention call; the others (prefill chunks) run one call each.
    """

    pool: KVPool
    slot_mapping: torch.Tensor  # (tokens,) flat slot of each scheduled token
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]

    def __post_init__(self) -> None:
        device = self.slot_mapping.device
        starts = [0]
        for q in self.query_lens:
            starts.append(starts[-1] + q)
        self.query_starts = starts
        decode = [i for i, q in enumerate(self.query_lens) if q == 1]
        self.prefill = [i for i, q in enumerate(self.query_lens) if q != 1]
        self.decode_tokens = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device)
        if decode:
            width = max(len(self.block_tables[i]) for i in decode)
            # Padding entries point at block 0; the key mask hides them.
            tables = [self.block_tables[i] + [0] * (width - len(self.block_tables[i])) for i in decode]
            self.decode_tables = torch.tensor(tables, dtype=torch.long, device=device)
            lens = [self.context_lens[i] for i in decode]
            ctx = torch.tensor(lens, device=device)
            # Keys past the longest context are padding in every row: cut them; equal lengths need no mask.
            self.decode_keys = max(lens)
            self.decode_uniform = min(lens) == self.decode_keys
            self.decode_key_pos = torch.arange(self.decode_keys, device=device)
            self.decode_query_pos = (ctx - 1)[:, None]  # (decode seqs, 1)
        self.prefill_tables = [
            torch.tensor(self.block_tables[i], dtype=torch.long, device=device) for i in self.prefill
        ]

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """(decode seqs, 1, 1, keys): real keys at or before the query, within the window if any."""
        if self.decode_uniform and window is None:
            return None  # lets SDPA take its unmasked (fastest) kernel
        key, query = self.decode_key_pos[None, :], self.decode_query_pos
        mask = key <= query
        if window is not None:
            mask &= key > query - window  # transformers' sliding window: the last `window` positions
        return mask[:, None, None, :]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor:
        """(1, 1, queries, keys) causal mask of one prefill sequence whose queries end its context."""
        q_len, ctx = self.query_lens[index], self.context_lens[index]
        device = self.slot_mapping.device
        query = torch.arange(ctx - q_len, ctx, device=device)[:, None]
        key = torch.arange(ctx, device=device)[None, :]
        mask = key <= query
        if window is not None:
            mask &= key > query - window
        return mask[None, None]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_context: PagedContext | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers' `AttentionInterface`: write this step's K/V to the pool, attend through it.

    `query` is `(1, heads, tokens, head_dim)`, `key`/`value` `(1, kv_heads, tokens, head_dim)`; returns
    `(1, tokens, heads, head_dim)` as every transformers attention function does.
    """
    if paged_context is None:
        raise RuntimeError("kvlab_paged attention needs a PagedContext: call the model through kvlab.engine")
    if softcap is not None:
        raise NotImplementedError("logit soft-capping (Gemma 2) is not supported by the paged attention")
    ctx, layer = paged_context, module.layer_idx
    q = query[0].transpose(0, 1)  # (tokens, heads, head_dim)
    ctx.pool.write(layer, ctx.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = torch.empty_like(q)
    gqa = query.shape[1] != key.shape[1]
    if len(ctx.decode_tokens):
        k, v = ctx.pool.gather(layer, ctx.decode_tables)
        k, v = k[:, :, : ctx.decode_keys], v[:, :, : ctx.decode_keys]
        qd = q[ctx.decode_tokens][:, :, None, :]  # (seqs, heads, 1, head_dim)
        o = F.scaled_dot_product_attention(
            qd, k, v, attn_mask=ctx.decode_mask(sliding_window), scale=scaling, enable_gqa=gqa
        )
        out[ctx.decode_tokens] = o[:, :, 0, :].to(out.dtype)
    for index, table in zip(ctx.prefill, ctx.prefill_tables, strict=True):
        start, end = ctx.query_starts[index], ctx.query_starts[index + 1]
        k, v = ctx.pool.gather(layer, table[None])
        k, v = k[:, :, : ctx.context_lens[index]], v[:, :, : ctx.context_lens[index]]
        qp = q[start:end].transpose(0, 1)[None]  # (1, heads, queries, head_dim)
        o = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=ctx.prefill_mask(index, sliding_window), scale=scaling, enable_gqa=gqa
        )
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
    return out[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


_CONFIGS: WeakKeyDictionary[PreTrainedModel, list[PretrainedConfig]] = WeakKeyDictionary()


def _attention_configs(model: PreTrainedModel) -> list[PretrainedConfig]:
    """Every distinct config object among the model's modules, found once per model (this runs every step)."""
    if model not in _CONFIGS:
        found = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
        _CONFIGS[model] = list(found.values())
    return _CONFIGS[model]


@contextmanager
def use_paged_attention(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Route the model's attention layers to `paged_attention_forward` inside the block, then restore."""
    configs = _attention_configs(model)
    saved = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = ATTN_IMPLEMENTATION
    try:
        yield model
    finally:
        for c, impl in zip(configs, saved, strict=True):
            c._attn_implementation = impl
