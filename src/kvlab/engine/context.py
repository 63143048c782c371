"""One step's plan for the paged attention: where each token is written, and which blocks each request reads.

All tokens a step schedules, from every request, form one flat batch row. `PagedContext.build` turns the step's
query lengths, context lengths and block tables into what every layer shares: the slot of each token, the block
ids to gather, `DecodeGroup`s of one-token requests attended in one padded call, and `PrefillChunk`s attended
one call each. It is built once per step, like nano-vllm's `Context`, and travels to the attention as a keyword
argument of the model's forward.

Requests come decodes first, longest context first (the runner's one order), so each decode group is a slice of
the flat batch. Chapters 7 and 8.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.engine.kv_pool import KVPool, KVShape


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
        """Group a step's requests (in flat-batch order) into decode groups and prefill chunks.

        One-token requests must come longest block table first, as the runner orders them."""
        device = slot_mapping.device
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        widths = [len(block_tables[i]) for i in decode]
        if any(a < b for a, b in zip(widths, widths[1:], strict=False)):
            raise ValueError(f"one-token requests must come longest block table first, got widths {widths}")
        block_ids: list[int] = []
        groups = []
        chunks = []
        begin = 0
        for end in split_by_width(widths):
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
