"""The paged attention: transformers' attention function that writes K/V to the pool and reads through it.

`paged_attention_forward` is registered with transformers' `AttentionInterface` as ``"kvlab_paged"``, and
`enable_paged_attention` switches a model to it once, through transformers' public `set_attn_implementation`.
Every attention layer then calls it with its fresh Q, K and V (RoPE applied). It writes K and V into the layer's
pool at the step's slots, then attends each request's queries to its whole context read back through its block
table, as the step's `PagedContext` lays out. A call without a context (`model.generate`) runs transformers' own
SDPA attention, so a model stays usable while and after an engine runs on it (nano-vllm's `layers/attention.py`).
Chapters 7 and 8.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvlab.engine.context import PagedContext

ATTN_IMPLEMENTATION = "kvlab_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_context: PagedContext | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers' `AttentionInterface`: write this step's K/V to the pool, attend through it.

    `query` is `(1, heads, tokens, head_dim)`, `key`/`value` `(1, kv_heads, tokens, head_dim)`; returns
    `(1, tokens, heads, head_dim)` as every transformers attention function does. Without a `PagedContext` it is
    transformers' SDPA attention, with the mask transformers prepared.
    """
    if paged_context is None:
        mask = attention_mask.build() if isinstance(attention_mask, DeferredMask) else attention_mask
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
            softcap=softcap, **kwargs,
        )  # fmt: skip
    if softcap is not None:
        raise NotImplementedError("logit soft-capping (Gemma 2) is not supported by the paged attention")
    ctx, layer = paged_context, int(module.layer_idx)  # type: ignore[arg-type]
    if ctx.by_layer is not None:
        ctx = ctx.by_layer[layer]
    pool = ctx.pool
    # (tokens, heads, head_dim)
    q = query[0].transpose(0, 1)
    pool.write(layer, ctx.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    decodes, prefills = ctx.decodes, ctx.prefills
    # A step of decodes only returns the group's output as is
    whole = len(decodes) == 1 and not prefills and isinstance(decodes[0].tokens, slice)
    out = None if whole else torch.empty_like(q)
    # The gather in the workspace, by its index in `ctx.gathers`
    loaded = -1
    for group in decodes:
        if group.unit != loaded:
            pool.load(layer, ctx.gathers[group.unit])
            loaded = group.unit
        k, v = group.keys_values(pool.workspace, pool.shape)
        # One query token per sequence: the query heads that share a KV head become that head's query rows
        # (seqs, kv_heads, heads per KV head, head_dim), so SDPA reads each KV head once. Query head i uses KV
        # head i // (heads / kv_heads), as transformers' repeat_kv has it. On this CPU (torch 2.13) that call took
        # half the time of the same SDPA with enable_gqa (benchmarks/bench_paged_attention.py prints both).
        queries = q[group.tokens].view(group.num_seqs, k.shape[1], -1, q.shape[-1])
        o = F.scaled_dot_product_attention(
            queries, k, v, attn_mask=group.mask(sliding_window, q.device, q.dtype), scale=scaling
        ).reshape(group.num_seqs, -1, q.shape[-1])
        if out is None:
            return o[None], None
        out[group.tokens] = o
    assert out is not None
    gqa = query.shape[1] != key.shape[1]
    for chunk in prefills:
        # Nothing cached before it: its K/V are this step's
        if chunk.blocks is None:
            k, v = key[:, :, chunk.start : chunk.end], value[:, :, chunk.start : chunk.end]
        else:
            if chunk.unit != loaded:
                pool.load(layer, ctx.gathers[chunk.unit])
                loaded = chunk.unit
            k, v = chunk.keys_values(pool.workspace, pool.shape)
        mask = chunk.mask(sliding_window, q.device, q.dtype)
        o = F.scaled_dot_product_attention(
            q[chunk.start : chunk.end].transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
            scale=scaling, enable_gqa=gqa,
        )  # fmt: skip
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out[None], None


class DeferredMask:
    """The arguments of transformers' SDPA mask, built only if a layer runs without a `PagedContext`.

    Registered as the ``"kvlab_paged"`` mask function, so a plain call (`model.generate`) gets the mask SDPA would,
    while an engine step, whose masks the `PagedContext` carries, never pays for one over its flat batch.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.mask: torch.Tensor | None = None
        self.built = False

    def build(self) -> torch.Tensor | None:
        # Once per forward, not once per layer
        if not self.built:
            self.mask, self.built = sdpa_mask(**self.kwargs), True
        return self.mask


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, DeferredMask)


def enable_paged_attention(model: PreTrainedModel) -> None:
    """Switch the model's attention to `paged_attention_forward`, once, with transformers' public switch.

    Idempotent; calls without a `PagedContext` keep transformers' SDPA behaviour, so nothing needs restoring.
    """
    # transformers 5.24 has no public getter for the current implementation; the config attribute is what it reads.
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{type(model).__name__} cannot switch its attention implementation (see the warning above)"
        )
