"""Paged KV storage and the attention that reads through block tables.

Every layer owns a pool of fixed-size blocks, `num_blocks × block_size × kv_heads × head_dim`, for K and for V. A
sequence's cache is a list of block ids (its block table); token `i` of a sequence lives in block
`table[i // block_size]` at offset `i % block_size`, i.e. in slot `block * block_size + offset` of the pool.

How the model runs on it (the design of nano-vllm): all tokens a step schedules, from every sequence, are
flattened into one batch row and passed with their `position_ids`. `paged_attention_forward` is registered with
transformers' `AttentionInterface` as ``"kvlab_paged"``, and `enable_paged_attention` switches a model to it once,
through transformers' public `set_attn_implementation`. Every attention layer then calls it with the layer's fresh
Q, K and V (RoPE applied). It writes K and V into the layer's pool through the step's slot mapping, then attends
each sequence's queries to its whole context read back through its block table. The per-step `PagedContext`
(slot mapping, `DecodeGroup`s of one-token sequences and a list of `PrefillChunk`s) travels as a keyword argument
of the model's forward, which transformers passes down to the attention function; `module.layer_idx` selects the
layer's pool. The context carries the masks (causal within the context, plus a sliding window when the layer has
one), so the mask transformers prepares is never built on that path. A call without a `PagedContext`
(`model.generate`, a plain forward) runs transformers' own SDPA attention with that mask, so a model stays usable
while and after an engine runs on it.

What keeps it fast on a CPU: the block indices are built once per step and shared by all layers; each layer reads
the blocks it needs with one `index_select` per K and V per run of at most `GATHER_CHUNK_BYTES` (one run on a GPU)
into a workspace reused across runs, layers and steps (a fresh allocation per layer costs more than the copy, and a
small run is still in cache when SDPA reads it); and a prefill chunk with nothing cached before it attends to the
step's own K and V without reading the pool back at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvlab.kv_format import SCALE_DTYPE, pool_format
from kvlab.specs.arch import describe
from kvlab.specs.layers import SlidingWindowAttention

ATTN_IMPLEMENTATION = "kvlab_paged"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose caches share block tables: one attention kind (`window` None for full attention)."""

    window: int | None
    layers: tuple[int, ...]


def kv_cache_groups(config: PretrainedConfig) -> list[KVCacheGroup]:
    """The model's layers in KV-cache groups of equal size, as vLLM's hybrid KV cache manager forms them.

    One group when every layer has the same attention kind (Llama: all full; Mistral: all one window). A hybrid
    model (Gemma 3: five sliding layers to one full) is cut into groups of the smallest kind's layer count, so
    that every group's block spans the same number of layers and all groups draw on one pool of equal blocks
    (vLLM 0.33.0, `vllm/v1/core/kv_cache_planning.py`, `_get_kv_cache_groups_uniform_page_size`). Full groups
    come first, then sliding groups by window.
    """
    by_kind: dict[int | None, list[int]] = {}
    for i, layer in enumerate(describe(config).layers):
        window = layer.window if isinstance(layer, SlidingWindowAttention) else None
        by_kind.setdefault(window, []).append(i)
    size = min(len(layers) for layers in by_kind.values())
    groups = []
    for window in sorted(by_kind, key=lambda w: (w is not None, w or 0)):
        layers = by_kind[window]
        groups += [KVCacheGroup(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    return groups


@dataclass(frozen=True)
class KVShape:
    """What one block holds: `block_size` tokens of `kv_heads × head_dim` for K and again for V, in each of
    `num_layers` layer rows. A block spans every layer, except in a hybrid model, where it spans one KV-cache
    group's layers and `layer_rows` gives each model layer's row (its place in its group)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    # None: layer i is row i
    layer_rows: tuple[int, ...] | None = None

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> KVShape:
        spec = describe(config)
        if any(layer.kind not in ("full", "sliding") for layer in spec.layers):
            raise ValueError(
                f"{spec.model_type}: the paged cache supports per-head K/V layers only (not MLA)"
            )
        shapes = {(layer.kv_heads, layer.head_dim, layer.v_head_dim) for layer in spec.layers}  # type: ignore[attr-defined]
        if len(shapes) != 1 or next(iter(shapes))[1] != next(iter(shapes))[2]:
            raise ValueError(
                f"{spec.model_type}: layers must share one K/V shape to share a pool, got {shapes}"
            )
        kv_heads, head_dim, _ = shapes.pop()
        groups = kv_cache_groups(config)
        if len(groups) == 1:
            return cls(spec.num_layers, kv_heads, head_dim)
        rows = [0] * spec.num_layers
        for group in groups:
            for row, layer in enumerate(group.layers):
                rows[layer] = row
        return cls(max(len(g.layers) for g in groups), kv_heads, head_dim, tuple(rows))

    def row(self, layer_idx: int) -> int:
        return layer_idx if self.layer_rows is None else self.layer_rows[layer_idx]


class KVPool:
    """The physical cache: one tensor `(layers, 2, num_blocks, block_size, kv_heads, head_dim)`, allocated once.

    `kv_cache_dtype` (vLLM's name): ``"auto"`` stores K and V in `dtype`, the model's. ``"fp8"`` (e4m3) and
    ``"int8"`` store `kv` as one byte per element and `scales`, one fp16 scale per token and head
    `(layers, 2, num_blocks, block_size, kv_heads)`: `write` quantizes (`kvlab.kv_format.quantize_fp8` /
    `quantize_int8`), `gather` dequantizes the blocks it reads into the workspace, in `dtype`.
    """

    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        self.format = pool_format(kv_cache_dtype)
        # What attention reads: the model's dtype
        self.dtype = dtype
        dims = (shape.num_layers, 2, num_blocks, block_size, shape.kv_heads)
        self.kv = torch.zeros(*dims, shape.head_dim, dtype=self.format.code_dtype or dtype, device=device)
        self.scales: torch.Tensor | None = None
        if self.format.quantized:
            self.scales = torch.zeros(dims, dtype=SCALE_DTYPE, device=device)
        # Where `gather` copies blocks to: (2, blocks, block_size * kv_heads * head_dim), grown on demand.
        self.workspace = torch.empty(
            2, 0, block_size * shape.kv_heads * shape.head_dim, dtype=dtype, device=device
        )
        # Per layer row, K and V viewed by slot and by block, made once: a view per call costs as much as the
        # copy of a decode step's token
        codes = self.kv.view(torch.uint8) if self.format.quantized else self.kv
        self._by_slot = [
            [codes[row, i].view(-1, *self.kv.shape[4:]) for i in (0, 1)] for row in range(shape.num_layers)
        ]
        self._by_block = [
            [codes[row, i].view(num_blocks, -1) for i in (0, 1)] for row in range(shape.num_layers)
        ]

    @staticmethod
    def bytes_per_token(shape: KVShape, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one token slot: every layer row, K and V, each head's codes plus scale when quantized."""
        per_head = pool_format(kv_cache_dtype).bytes_per_head_token(shape.head_dim, dtype)
        return shape.num_layers * 2 * shape.kv_heads * per_head

    @property
    def block_bytes(self) -> int:
        """Bytes one block of K (or of V) of one layer takes once gathered, in the model's dtype."""
        return self.workspace.shape[2] * self.workspace.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the pool itself, scales included (not the gather workspace, which is activation memory)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the pool holds: `kv`, and `scales` when quantized."""
        return [self.kv] if self.scales is None else [self.kv, self.scales]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools of one layer, each `(num_blocks, block_size, kv_heads, head_dim)` (codes when quantized)."""
        row = self.shape.row(layer_idx)
        return self.kv[row, 0], self.kv[row, 1]

    def write(self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `(tokens, kv_heads, head_dim)` K and V at flat slot indices `block * block_size + offset`."""
        row = self.shape.row(layer_idx)
        for i, x in enumerate((key, value)):
            flat = self._by_slot[row][i]
            if self.scales is None:
                flat.index_copy_(0, slots, x if x.dtype == flat.dtype else x.to(flat.dtype))
                continue
            assert self.format.quantize is not None
            codes, scale = self.format.quantize(x)
            # index_copy_ has no float8 kernel on CPU: the codes are copied as bytes
            flat.index_copy_(0, slots, codes.view(torch.uint8))
            self.scales[row, i].view(-1, self.shape.kv_heads).index_copy_(0, slots, scale[..., 0])

    def read_tokens(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """A copy of K and V of token positions `start..end-1` of a sequence with this block table, as
        `(layers, 2, end - start, kv_heads, head_dim)` in the pool's dtype: what a prefill instance sends."""
        self._check_plain("read tokens out of")
        slots = torch.tensor(slots_for(block_table, start, end, self.block_size), device=self.kv.device)
        flat = self.kv.view(*self.kv.shape[:2], -1, *self.kv.shape[4:])
        return flat.index_select(2, slots)

    def write_tokens(self, block_table: list[int], start: int, kv: torch.Tensor) -> None:
        """Store `(layers, 2, tokens, kv_heads, head_dim)` K and V at positions `start..` of a sequence with this
        block table (the inverse of `read_tokens`): what a decode instance does with what it receives."""
        self._check_plain("write tokens into")
        expected = (self.kv.shape[0], 2, kv.shape[2], *self.kv.shape[4:])
        if tuple(kv.shape) != expected or kv.dtype != self.kv.dtype:
            raise ValueError(
                f"K/V {tuple(kv.shape)} {kv.dtype} does not fit this pool's {expected} {self.kv.dtype}"
            )
        slots = slots_for(block_table, start, start + kv.shape[2], self.block_size)
        flat = self.kv.view(*self.kv.shape[:2], -1, *self.kv.shape[4:])
        flat.index_copy_(2, torch.tensor(slots, device=self.kv.device), kv.to(self.kv.device))

    def _check_plain(self, what: str) -> None:
        if self.format.quantized or self.shape.layer_rows is not None:
            raise ValueError(
                f"only a pool of one KV-cache group stored in the model's dtype can {what} (kv_cache_dtype 'auto')"
            )

    def gather(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks as `(len(block_ids), block_size, kv_heads, head_dim)` each, in the model's dtype.

        They are views of the workspace, valid until the next gather (`load`).
        """
        self.load(layer_idx, block_ids)
        n = block_ids.numel()
        return self.workspace[0, :n].view(n, *self.kv.shape[3:]), self.workspace[1, :n].view(
            n, *self.kv.shape[3:]
        )

    def load(self, layer_idx: int, block_ids: torch.Tensor) -> None:
        """Copy K and V of these blocks into the first rows of `workspace`, in the model's dtype.

        One `index_select` per pool (a memcpy per block), into memory that is already mapped, instead of a new
        allocation in every layer of every step. A quantized pool's codes and scales are selected the same way, then
        dequantized into the workspace.
        """
        n = block_ids.numel()
        if self.workspace.shape[1] < n:
            self.workspace = self.workspace.new_empty(
                2, max(n, 2 * self.workspace.shape[1]), self.workspace.shape[2]
            )
        row = self.shape.row(layer_idx)
        for i, pool in enumerate(self._by_block[row]):
            rows = self.workspace[i, :n]
            if self.scales is None:
                torch.index_select(pool, 0, block_ids, out=rows)
                continue
            codes = torch.index_select(pool, 0, block_ids)
            scales = torch.index_select(self.scales[row, i].view(self.num_blocks, -1), 0, block_ids)
            rows.copy_(codes.view(self.kv.dtype))
            rows.view(n, -1, self.shape.head_dim).mul_(scales.view(n, -1, 1))


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat pool slots of token positions `start..end-1` of a sequence with this block table."""
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


def _causal_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """0 for keys at or before each query, and within the last `window` positions if any (transformers' sliding
    window), -inf for the others: the additive form, which SDPA would otherwise make from a boolean mask in every
    layer."""
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))


@dataclass
class DecodeGroup:
    """Sequences computing one token this step, attended in one padded SDPA call per layer.

    A step's decode sequences are split into groups of similar context length, so that padding every row to the
    longest context does not double the keys read (with mixed lengths about half of them were padding).
    """

    # Where their tokens sit in the step's flat batch (a slice when consecutive)
    tokens: torch.Tensor | slice
    # Their rows of the step's gather index: seqs × width, padding pointing at block 0
    blocks: slice
    # The longest context; keys past it are padding in every row
    num_keys: int
    # Each sequence's context length
    context_lens: list[int]
    # All contexts equally long: no mask needed without a window
    uniform: bool
    # Per window, built on first use
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    # Which of the step's gathers holds its blocks, and its rows there
    unit: int = 0
    rows: slice = field(default_factory=lambda: slice(0))
    # Its K and V views of the workspace they were made on: every layer gathers into the same rows
    views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def keys_values(self, workspace: torch.Tensor, shape: KVShape) -> tuple[torch.Tensor, torch.Tensor]:
        """(seqs, kv_heads, keys, head_dim) views of its gathered K and V."""
        if self.views is None or self.views[0] is not workspace:
            k, v = (
                w[self.rows]
                .view(self.num_seqs, -1, shape.kv_heads, shape.head_dim)[:, : self.num_keys]
                .transpose(1, 2)
                for w in workspace
            )
            self.views = (workspace, k, v)
        return self.views[1], self.views[2]

    def mask(self, window: int | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """(seqs, 1, 1, keys) additive mask: real keys at or before the query, within the window if any; None when
        all keys are."""
        if window not in self.masks:
            if self.uniform and (window is None or window >= self.num_keys):
                # Lets SDPA take its unmasked (fastest) kernel
                self.masks[window] = None
            else:
                key = torch.arange(self.num_keys, device=device)[None, :]
                query = torch.tensor(self.context_lens, device=device)[:, None] - 1
                self.masks[window] = _causal_mask(query, key, window, dtype)[:, None, None]
        return self.masks[window]


# One more SDPA call costs about as much as padding this many block rows
GROUP_COST_BLOCKS = 8

# On a CPU, a decode group reads its K and V in chunks of sequences of at most this many bytes (at least one
# sequence): the copy lands in a workspace small enough to stay in cache until SDPA reads it, instead of going
# out to memory and back. With one thread this cut paged attention from 2.0x to 1.6x contiguous SDPA
# (benchmarks/bench_paged_attention.py). A GPU reads each group in one gather: a call there costs a kernel launch.
GATHER_CHUNK_BYTES = 16 << 20


def split_by_width(widths: list[int], group_cost: int = GROUP_COST_BLOCKS) -> list[int]:
    """Cut points of `widths` (sorted longest first) into groups, minimising padded rows + `group_cost` per group.

    Returns the end index of each group. Dynamic programming over the cut points: a group `[i, j)` costs
    `(j - i) * widths[i] + group_cost`. Only the places where the width changes are tried: a cut inside a run
    of equal widths is never better than one at the run's start (the rows after it pad to the same width
    either way), so the work grows with the distinct widths squared, not the sequences.
    """
    n = len(widths)
    cuts = [i for i in range(n) if i == 0 or widths[i] != widths[i - 1]] + [n]
    # best[c]: the least cost of the rows before cuts[c]; back[c]: where the last group before it starts
    best = [0] * len(cuts)
    back = [0] * len(cuts)
    for c in range(1, len(cuts)):
        j = cuts[c]
        best[c], back[c] = min((best[b] + (j - cuts[b]) * widths[cuts[b]] + group_cost, b) for b in range(c))
    ends = []
    c = len(cuts) - 1
    while c:
        ends.append(cuts[c])
        c = back[c]
    return ends[::-1]


@dataclass
class PrefillChunk:
    """One sequence computing several tokens: the last `query_len` tokens of its `context_len`-token context."""

    # Its first token in the step's flat batch
    start: int
    query_len: int
    context_len: int
    # Its rows of the step's gather index; None when nothing is cached before the chunk
    blocks: slice | None
    # Per window, built on first use
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    # Which of the step's gathers holds its blocks, and its rows there
    unit: int = 0
    rows: slice = field(default_factory=lambda: slice(0))
    # Its K and V views of the workspace they were made on: every layer gathers into the same rows
    views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def end(self) -> int:
        return self.start + self.query_len

    def keys_values(self, workspace: torch.Tensor, shape: KVShape) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, kv_heads, context, head_dim) views of its gathered K and V."""
        if self.views is None or self.views[0] is not workspace:
            k, v = (
                w[self.rows]
                .view(-1, shape.kv_heads, shape.head_dim)[: self.context_len]
                .transpose(0, 1)[None]
                for w in workspace
            )
            self.views = (workspace, k, v)
        return self.views[1], self.views[2]

    def mask(self, window: int | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """(1, 1, queries, keys) additive causal mask; None for a plain causal chunk (SDPA's `is_causal` does it)."""
        if window not in self.masks:
            if self.blocks is None and (window is None or window >= self.context_len):
                self.masks[window] = None
            else:
                query = torch.arange(self.context_len - self.query_len, self.context_len, device=device)[
                    :, None
                ]
                key = torch.arange(self.context_len, device=device)[None, :]
                self.masks[window] = _causal_mask(query, key, window, dtype)[None, None]
        return self.masks[window]


@dataclass
class PagedContext:
    """What one forward step needs to read and write the pool; built once per step, shared by all layers.

    The step's tokens are flat: sequence `i` owns `query_lens[i]` consecutive tokens, the last of its context of
    `context_lens[i]` tokens (context includes them). One-token sequences form the `decodes` groups; the others are
    `prefills`, attended one call each. `block_ids` lists every block any layer reads this step, decode rows first.
    """

    pool: KVPool
    # (tokens,) flat slot of each scheduled token
    slot_mapping: torch.Tensor
    # (blocks,) what each layer gathers, built once per step
    block_ids: torch.Tensor
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # `block_ids` cut into the runs a layer gathers at once (one run on a GPU)
    gathers: list[torch.Tensor]
    # Hybrid models: each layer's group's context (own block tables)
    by_layer: list[PagedContext] | None = None

    @classmethod
    def build(
        cls,
        pool: KVPool,
        slot_mapping: torch.Tensor,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> PagedContext:
        """Group a step's sequences (in flat-batch order) into decode groups and prefill chunks."""
        device = slot_mapping.device
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        decode = sorted((i for i, q in enumerate(query_lens) if q == 1), key=lambda i: -len(block_tables[i]))
        block_ids: list[int] = []
        groups = []
        chunks = []
        begin = 0
        for end in split_by_width([len(block_tables[i]) for i in decode]):
            width = len(block_tables[decode[begin]])
            step = (
                max(1, GATHER_CHUNK_BYTES // (2 * width * pool.block_bytes)) if device.type == "cpu" else end
            )
            chunks += [decode[first : min(first + step, end)] for first in range(begin, end, step)]
            begin = end
        for members in chunks:
            width, first = len(block_tables[members[0]]), len(block_ids)
            # Padding entries point at block 0; the key mask hides them
            for i in members:
                block_ids += block_tables[i] + [0] * (width - len(block_tables[i]))
            lens = [context_lens[i] for i in members]
            tokens = [starts[i] for i in members]
            consecutive = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
            groups.append(
                DecodeGroup(
                    tokens=slice(tokens[0], tokens[-1] + 1)
                    if consecutive
                    else torch.tensor(tokens, device=device),
                    blocks=slice(first, len(block_ids)),
                    num_keys=max(lens),
                    context_lens=lens,
                    uniform=min(lens) == max(lens),
                )
            )
        prefills = []
        for i, q in enumerate(query_lens):
            if q == 1:
                continue
            rows = None
            # Earlier tokens are only in the pool
            if context_lens[i] > q:
                rows = slice(len(block_ids), len(block_ids) + len(block_tables[i]))
                block_ids += block_tables[i]
            prefills.append(PrefillChunk(starts[i], q, context_lens[i], rows))
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        # Consecutive parts share a gather while their K and V fit the chunk size (all of them on a GPU)
        limit = GATHER_CHUNK_BYTES // (2 * pool.block_bytes) if device.type == "cpu" else len(block_ids)
        cuts: list[int] = [0]
        parts: list[DecodeGroup | PrefillChunk] = [*groups, *prefills]
        for part in parts:
            rows = part.blocks
            if rows is None:
                continue
            if rows.stop - cuts[-1] > limit and rows.start > cuts[-1]:
                cuts.append(rows.start)
            part.unit, part.rows = len(cuts) - 1, slice(rows.start - cuts[-1], rows.stop - cuts[-1])
        cuts.append(len(block_ids))
        gathers = [ids[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        return cls(pool, slot_mapping, ids, groups, prefills, gathers)


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
