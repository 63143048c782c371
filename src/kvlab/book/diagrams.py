"""The book's mechanism diagrams, each drawn from kvlab's own state so that it cannot drift from what kvlab does.

One function per diagram takes kvlab objects (a config's `ModelShape`, a `MemoryBudget`, a `BlockManager` and
its sequences, two `SimulationResult`s, a tensor-parallel plan) and returns a matplotlib `Figure`; every number
and id written on it is read from that state. `DIAGRAMS` names each diagram, the chapter page that shows it and
how to build it from kvlab's data; `tools/diagrams.py` (`make diagrams`) writes them to `book/diagrams/*.svg`.

Sizes follow the book's column (`kvlab.book.plot.COLUMN_INCHES`, 688 CSS px at a 1280-px window). A diagram is
`WIDTH_INCHES` wide and sets no text under `MIN_FONT_PT`: shown at its natural width (1 pt = 4/3 CSS px) its
text is at least 14 px, and shrunk to a phone's 365-px column (a 412-px window) still 11 × 365 / 432 = 9.3 px.
SVGs keep their text as text and are byte-for-byte reproducible (`save_svg`).
"""

from __future__ import annotations

import bisect
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib as mpl
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from kvlab.book import plot
from kvlab.costs.budget import MemoryBudget
from kvlab.engine.block_manager import BlockManager, ComputedBlocks
from kvlab.engine.request import Request
from kvlab.experiments.evict import reusable_prefix_blocks
from kvlab.planning.simulate import SimulationResult
from kvlab.specs.layers import FullAttention
from kvlab.specs.shape import ModelShape
from kvlab.units import cdiv, dtype_bytes, format_bytes

WIDTH_INCHES = 6.0
MIN_FONT_PT = 11.0
TITLE_PT = 12.0
# Fills, each paired with a hatch so that no meaning rests on colour alone.
FILLS = [
    (colour, hatch)
    for colour, hatch in zip(plot.PALETTE, ["", "//", "..", "xx", "\\\\", "++", "--", "oo"], strict=True)
]
FREE = "#ffffff"
CACHED = "#d9d9d9"
SVG_RC: dict[Any, Any] = {"svg.fonttype": "none", "svg.hashsalt": "kvlab-diagrams", "hatch.linewidth": 0.6}


def _canvas(height: float) -> tuple[Figure, Axes]:
    """A figure WIDTH_INCHES wide whose one axes is the whole figure, in inches: (0, 0) bottom left."""
    fig = Figure(figsize=(WIDTH_INCHES, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH_INCHES)
    ax.set_ylim(0, height)
    ax.set_axis_off()
    return fig, ax


def _text(
    ax: Axes, x: float, y: float, s: str, *, size: float = MIN_FONT_PT, gid: str | None = None, **kw: Any
):
    kw.setdefault("va", "center")
    kw.setdefault("ha", "left")
    artist = ax.text(x, y, s, fontsize=size, **kw)
    if gid is not None:
        artist.set_gid(gid)
    return artist


def _label(ax: Axes, x: float, y: float, s: str, *, gid: str | None = None):
    """Text centred at (x, y) on a white backing, readable over a hatched fill."""
    backing = {"facecolor": "white", "edgecolor": "none", "pad": 0.5}
    return _text(ax, x, y, s, ha="center", gid=gid, bbox=backing)


def _box(
    ax: Axes, x: float, y: float, w: float, h: float, face: str = FREE, hatch: str = "", **kw: Any
) -> None:
    kw.setdefault("edgecolor", "#333333")
    kw.setdefault("linewidth", 0.8)
    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, hatch=hatch, **kw))


def _light(face: str) -> str:
    """A paler version of a fill, so black text on it stays readable."""
    r, g, b = mpl.colors.to_rgb(face)
    return mpl.colors.to_hex((0.55 + 0.45 * r, 0.55 + 0.45 * g, 0.55 + 0.45 * b))


# --- 1. What the cache holds ---------------------------------------------------------------------------------


def cache_contents(shape: ModelShape, kv_bytes_per_token: int, tokens: int = 4) -> Figure:
    """Layers × {K, V} × KV heads × tokens of one sequence's cache, beside the hidden state it does not keep.

    `shape` is `kvlab.specs.shape.shape(config)` of a model whose layers all use full attention;
    `kv_bytes_per_token` is `kvlab.specs.sizing.kv_bytes_per_token(config)`, written on the figure with its product."""
    layers = shape.spec.layers
    if not layers or not all(type(layer) is FullAttention for layer in layers):
        raise ValueError(f"{shape.spec.name}: the cache-contents diagram draws full-attention layers only")
    first = layers[0]
    assert isinstance(first, FullAttention)
    if any(layer != first for layer in layers):
        raise ValueError(f"{shape.spec.name}: the cache-contents diagram needs every layer of one shape")
    heads, head_dim, n_layers = first.kv_heads, first.head_dim, len(layers)
    element = dtype_bytes(shape.dtype if isinstance(shape.dtype, str) else "bf16")
    fig, ax = _canvas(4.8)
    name = shape.spec.name.split("/")[-1]
    _text(ax, 0.1, 4.6, f"{name}: one sequence's KV cache", size=TITLE_PT, weight="bold")
    _text(ax, 0.1, 4.25, f"each grid: {heads} KV heads (rows) × {tokens} tokens", gid="grid")
    _text(ax, 0.1, 3.97, f"each cell: one head's {head_dim} values")
    cell_w, grid_h = 0.26, 0.62
    row_h = grid_h / heads
    shown = [0, 1, n_layers - 1] if n_layers > 3 else list(range(n_layers))
    tops = [3.45, 2.6, 1.4]
    for slot, (layer, top) in enumerate(zip(shown, tops, strict=False)):
        _text(ax, 0.1, top - grid_h / 2, f"layer {layer}", gid=f"layer-{layer}")
        for j, (label, x0) in enumerate((("K", 1.15), ("V", 2.6))):
            face, hatch = FILLS[j]
            _text(ax, x0 - 0.2, top - grid_h / 2, label, ha="center", weight="bold")
            for h in range(heads):
                for t in range(tokens):
                    _box(
                        ax,
                        x0 + t * cell_w,
                        top - (h + 1) * row_h,
                        cell_w,
                        row_h,
                        _light(face),
                        hatch,
                        linewidth=0.4,
                    )
        if slot == 1 and n_layers > 3:
            _text(ax, 1.15, 1.7, f"⋮  layers 2 to {n_layers - 2}, the same", gid="more-layers")
    _text(ax, 1.15, 0.55, f"tokens 1 to {tokens} →")
    # The hidden state per token and layer, to the same scale as one layer's K grid (heads × head_dim values).
    hidden = shape.hidden_size
    x0, top = 4.55, 3.45
    height = grid_h * hidden / (heads * head_dim)
    scale_note = "(K's scale)"
    if height > 2.5:
        height, scale_note = 2.5, "(not to scale)"
    for t in range(tokens):
        _box(ax, x0 + t * cell_w, top - height, cell_w, height, "#f2f2f2", "..", linestyle="--")
    _text(ax, 4.45, 4.25, "not cached:", weight="bold")
    _text(ax, 4.45, 3.97, "hidden state")
    _text(ax, 4.45, 3.69, f"{hidden:,} values", gid="hidden-size")
    _text(ax, 4.45, top - height - 0.25, "a token and layer")
    _text(ax, 4.45, top - height - 0.5, scale_note)
    _text(
        ax,
        0.1,
        0.2,
        f"per token: {n_layers} layers × 2 × {heads} heads × {head_dim} × {element} B = "
        f"{format_bytes(kv_bytes_per_token)}",
        gid="bytes-per-token",
    )
    return fig


# --- 2. The memory budget ------------------------------------------------------------------------------------


def budget_terms(budget: MemoryBudget) -> list[tuple[str, int, str]]:
    """The budget's terms top to bottom as (name, bytes, note), summing to the capacity: what the bar stacks."""
    if budget.kv_headroom_bytes < 0:
        raise ValueError(
            f"the budget does not fit: its terms exceed the capacity by {format_bytes(-budget.kv_headroom_bytes)}"
        )
    # The rule's own terms (`MemoryBudget.stack`), labelled by name; a utilisation share also by its setting
    util = budget.gpu_memory_utilization
    shares = {"engine cap": f"1 − {util:g}", "utilisation cap": f"at {util:g}"}
    terms = [(name, value, shares.get(name, "")) for name, value, _ in budget.stack()]
    terms += [
        ("KV pool", budget.kv_pool_bytes, f"{budget.num_blocks:,} blocks of {budget.block_size}"),
        ("block rounding", budget.rounding_bytes, ""),
    ]
    return [term for term in terms if term[1] > 0]


def budget_stack(budget: MemoryBudget, title: str) -> Figure:
    """One GPU's memory as one stacked bar of `budget`'s terms (`kvlab.costs.budget.memory_budget`), each labelled
    with its bytes; `title` names the model and GPU the budget is for."""
    terms = budget_terms(budget)
    fig, ax = _canvas(4.6)
    _text(ax, 0.1, 4.4, title, size=TITLE_PT, weight="bold")
    _text(
        ax,
        0.1,
        4.07,
        f"capacity {format_bytes(budget.capacity_bytes)} (what nvidia-smi reports)",
        gid="capacity",
    )
    x0, width, bottom, top = 0.35, 0.9, 0.2, 3.8
    per_byte = (top - bottom) / budget.capacity_bytes
    y = top
    centres = []
    for index, (name, value, _) in enumerate(terms):
        face, hatch = FILLS[index % len(FILLS)]
        if name == "KV pool":
            face, hatch = plot.PREDICTED, "//"
        height = value * per_byte
        _box(ax, x0, y - height, width, height, _light(face), hatch, linewidth=0.5)
        centres.append(y - height / 2)
        y -= height
    # Labels at their segment's height, pushed apart where segments are thin; a leader line joins each.
    gap = 0.3
    placed: list[float] = []
    for centre in centres:
        placed.append(min(centre, placed[-1] - gap) if placed else min(centre, top))
    shift = max(0.0, bottom + 0.1 - placed[-1])
    placed = [p + shift for p in placed]
    label_x = 1.75
    for (name, value, note), centre, at in zip(terms, centres, placed, strict=True):
        ax.plot(
            [x0 + width, x0 + width + 0.15, label_x - 0.08], [centre, centre, at], color="#555555", lw=0.7
        )
        extra = f" ({note})" if note else ""
        weight = "bold" if name == "KV pool" else "normal"
        _text(ax, label_x, at, f"{name}{extra}: {format_bytes(value)}", gid=f"term-{name}", weight=weight)
    return fig


# --- 3. A paged block table ----------------------------------------------------------------------------------


def block_table(manager: BlockManager, seqs: Sequence[Request]) -> Figure:
    """Each sequence's block table (logical block i → physical block id) and the physical pool beside it:
    blocks in use marked with their owner and logical index, cached blocks (a hash, no user) and free ones."""
    if not 1 <= len(seqs) <= 4:
        raise ValueError(f"the block-table diagram draws 1 to 4 sequences, got {len(seqs)}")
    if manager.num_blocks > 24:
        raise ValueError(
            f"the block-table diagram draws at most 24 blocks, the pool has {manager.num_blocks}"
        )
    tables = [manager.get_block_ids(seq.request_id)[0] for seq in seqs]
    owner: dict[int, tuple[int, int]] = {}
    for s, table in enumerate(tables):
        for logical, block_id in enumerate(table):
            owner.setdefault(block_id, (s, logical))
    per_row = 8
    rows = cdiv(manager.num_blocks, per_row)
    height = 1.05 + 0.5 * len(seqs) + 0.75 * rows + 0.85
    fig, ax = _canvas(height)
    top = height - 0.25
    _text(ax, 0.1, top, f"block tables (blocks of {manager.block_size} tokens)", size=TITLE_PT, weight="bold")
    cell, table_x = 0.62, 2.4
    y = top - 0.5
    for s, seq in enumerate(seqs):
        face, hatch = FILLS[s]
        _text(ax, 0.1, y, f"{seq.request_id}: {seq.num_tokens} tokens", gid=f"seq-{seq.request_id}")
        for logical, block_id in enumerate(tables[s]):
            _box(ax, table_x + logical * cell, y - 0.2, cell, 0.4, _light(face), hatch)
            _label(
                ax,
                table_x + (logical + 0.5) * cell,
                y,
                f"#{block_id}",
                gid=f"table-{seq.request_id}-{logical}",
            )
        y -= 0.5
    _text(ax, table_x, y + 0.05, "logical block 0, 1, 2, … → physical block id", va="center")
    y -= 0.45
    _text(ax, 0.1, y, f"physical pool: {manager.num_blocks} blocks", size=TITLE_PT, weight="bold")
    y -= 0.45
    ref_counts, hashes = manager.block_pool.ref_cnt, manager.block_pool.block_keys
    pool_w = (WIDTH_INCHES - 0.2) / per_row
    for block_id in range(manager.num_blocks):
        row, col = divmod(block_id, per_row)
        x, yb = 0.1 + col * pool_w, y - row * 0.75 - 0.55
        if ref_counts[block_id] > 0 and block_id in owner:
            s, logical = owner[block_id]
            face, hatch = FILLS[s]
            face = _light(face)
            state = f"{seqs[s].request_id} {logical}"
        elif ref_counts[block_id] > 0:
            face, hatch, state = CACHED, "", "in use"
        elif hashes[block_id] is not None:
            face, hatch, state = CACHED, "xx", "cached"
        else:
            face, hatch, state = FREE, "", "free"
        _box(ax, x + 0.03, yb, pool_w - 0.06, 0.55, face, hatch)
        _label(
            ax,
            x + pool_w / 2,
            yb + 0.38,
            f"#{block_id}",
            gid=f"pool-{block_id}-id",
        )
        _label(
            ax,
            x + pool_w / 2,
            yb + 0.14,
            state,
            gid=f"pool-{block_id}",
        )
    _text(ax, 0.1, 0.22, "cached: freed, keeps its hash for a later hit; free: reused first")
    return fig


# --- 4. The prefix-cache hash chain --------------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """A request admitted to a prefix-caching `BlockManager`, and the cached blocks its lookup found."""

    seq: Request
    hit_blocks: int  # blocks the lookup served
    cached_blocks: int  # leading blocks whose hashes were cached: more than hit_blocks when the last is


def admit_in_order(manager: BlockManager, prompts: Sequence[tuple[str, Sequence[int]]]) -> list[Admission]:
    """Admit each (request id, prompt) to `manager` in turn, whole, as the scheduler does; record its hit."""
    if not manager.enable_prefix_caching:
        raise ValueError("admit_in_order needs a BlockManager with enable_prefix_caching=True")
    out = []
    for request_id, tokens in prompts:
        seq = Request(list(tokens), request_id=request_id)
        hit = manager.get_computed_blocks(seq)
        index = manager.block_pool.cached_block_hash_to_block
        cached = 0
        while cached < len(seq.block_hashes) and (0, seq.block_hashes[cached]) in index:
            cached += 1
        admit_whole(manager, seq, hit)
        out.append(Admission(seq, hit.num_computed_tokens // manager.block_size, cached))
    return out


def admit_whole(manager: BlockManager, seq: Request, hit: ComputedBlocks | None = None) -> None:
    """Admit `seq` with its whole prompt scheduled, as the engine's scheduler would (it alone counts progress)."""
    hit = manager.get_computed_blocks(seq) if hit is None else hit
    seq.shared_prefix_boundary = hit.shared_prefix_boundary
    if not manager.allocate_slots(
        seq, seq.num_tokens - hit.num_computed_tokens, hit.num_computed_tokens, hit
    ):
        raise ValueError(f"request {seq.request_id} does not fit in the pool")
    seq.num_computed_tokens = seq.num_tokens


def short_hash(value: int) -> str:
    """The first 6 hex digits of a 128-bit block hash, as the diagram writes it."""
    return f"{value:032x}"[:6]


def hash_chain(manager: BlockManager, admissions: Sequence[Admission]) -> Figure:
    """Each request's blocks with their chained hashes (`kvlab.engine.block_pool.hash_block_tokens`, shortened), what its
    lookup hit, where the second request's hashes first differ from the first's, and the blocks computed again
    although cached (a prompt's last block: at least one token is always computed)."""
    if len(admissions) < 2:
        raise ValueError("the hash-chain diagram needs at least two requests")
    bs = manager.block_size
    first, second = admissions[0].seq, admissions[1].seq
    diverge = next(
        (i for i, (a, b) in enumerate(zip(first.block_hashes, second.block_hashes, strict=False)) if a != b),
        min(len(first.block_hashes), len(second.block_hashes)),
    )
    width = max(cdiv(a.seq.num_prompt_tokens, bs) for a in admissions)
    box_w, gap, x0 = 1.1, 0.2, 0.5
    if x0 + width * (box_w + gap) > WIDTH_INCHES:
        raise ValueError(f"the hash-chain diagram draws at most 4 blocks a prompt, got {width}")
    height = 1.7 + 1.2 * (len(admissions) - 1)
    fig, ax = _canvas(height)
    _text(
        ax, 0.1, height - 0.25, f"block hashes, chained (blocks of {bs} tokens)", size=TITLE_PT, weight="bold"
    )
    for r, admission in enumerate(admissions):
        seq, y = admission.seq, height - 0.95 - 1.2 * r
        _text(ax, 0.1, y, seq.request_id or "", weight="bold")
        tokens = seq.token_ids[: seq.num_prompt_tokens]
        for i in range(cdiv(len(tokens), bs)):
            x = x0 + i * (box_w + gap)
            chunk = tokens[i * bs : (i + 1) * bs]
            full = len(chunk) == bs
            if i < admission.hit_blocks:
                status, face, hatch = "hit", _light(plot.PALETTE[3]), "//"
            elif i < admission.cached_blocks:
                status, face, hatch = "recomputed", _light(plot.PALETTE[2]), "xx"
            else:
                status, face, hatch = "computed", FREE, ""
            _box(ax, x, y - 0.3, box_w, 0.6, face, hatch)
            label = " ".join(str(t) for t in chunk)
            _label(
                ax,
                x + box_w / 2,
                y + 0.13,
                label,
                gid=f"tokens-{seq.request_id}-{i}",
            )
            digest = f"#{short_hash(seq.block_hashes[i])}" if full else "no hash"
            _label(
                ax,
                x + box_w / 2,
                y - 0.14,
                digest,
                gid=f"hash-{seq.request_id}-{i}",
            )
            _text(ax, x + box_w / 2, y - 0.5, status, ha="center", gid=f"status-{seq.request_id}-{i}")
            if i:
                ax.add_patch(
                    FancyArrowPatch((x - gap, y), (x, y), arrowstyle="-|>", mutation_scale=9, lw=0.8)
                )
    x = x0 + diverge * (box_w + gap) - gap / 2
    y_top, y_bottom = height - 0.55, height - 0.95 - 1.2 - 0.65
    ax.plot([x, x], [y_bottom, y_top], color=plot.MEASURED, lw=1.4, ls="--")
    _text(
        ax,
        x + 0.06,
        y_top - 0.02,
        f"{second.request_id} diverges at block {diverge}",
        color=plot.MEASURED,
        gid="divergence",
        va="bottom",
    )
    return fig


# --- 4b. Eviction and the hash chain ---------------------------------------------------------------------------


def kept_tokens(rows: Sequence[tuple[str, Sequence[int]]], prompt_tokens: int, block_size: int) -> Figure:
    """Which of a prompt's tokens each cache kept (one row per cache or KV head: its kept positions, in
    order), cut into blocks, with the first block that lost a token: the prefix hash chain ends there."""
    if not 1 <= len(rows) <= 8:
        raise ValueError(f"the kept-tokens diagram draws 1 to 8 rows, got {len(rows)}")
    blocks = cdiv(prompt_tokens, block_size)
    if not 1 <= blocks <= 16:
        raise ValueError(f"the kept-tokens diagram draws 1 to 16 blocks, got {blocks}")
    height = 1.2 + 0.62 * len(rows)
    fig, ax = _canvas(height)
    title = f"tokens kept of a {prompt_tokens}-token prompt (blocks of {block_size})"
    _text(ax, 0.1, height - 0.25, title, size=TITLE_PT, weight="bold")
    x0, x1 = 0.1, WIDTH_INCHES - 0.1
    cell = (x1 - x0) / prompt_tokens
    for r, (name, positions) in enumerate(rows):
        y = height - 0.95 - 0.62 * r
        kept = set(positions)
        if len(kept) != len(positions) or not kept <= set(range(prompt_tokens)):
            raise ValueError(f"{name}: positions must be distinct and below {prompt_tokens}")
        broken = reusable_prefix_blocks(torch.tensor(sorted(kept)), block_size)
        whole = f"{broken} of {blocks} blocks whole" if broken < blocks else "every block whole"
        _text(ax, x0, y + 0.2, f"{name}: {len(kept)} kept, {whole}", gid=f"row-{r}")
        for t in sorted(kept):
            ax.add_patch(Rectangle((x0 + t * cell, y - 0.17), cell, 0.22, facecolor=plot.PREDICTED, lw=0))
        for b in range(blocks):
            _box(ax, x0 + b * block_size * cell, y - 0.17, block_size * cell, 0.22, "none")
        if broken < blocks:
            x = x0 + broken * block_size * cell
            ax.plot([x, x], [y - 0.24, y + 0.09], color=plot.MEASURED, lw=2)
    _text(ax, x0, 0.22, "dark: kept; red bar: first block with a dropped token, where the chain ends")
    return fig


# --- 5. Static against continuous batching -------------------------------------------------------------------


def request_steps(result: SimulationResult) -> list[tuple[int, int]]:
    """Each request's (first, last) engine step, counted from 1, from its times and the steps' end times."""
    ends = [s.time for s in result.step_stats]
    if not ends:
        raise ValueError("the run recorded no steps: simulate with record_steps=True")
    spans = []
    for m in result.requests:
        if m.first_scheduled_time is None or m.finish_time is None:
            raise ValueError("every request of the run must have finished")
        spans.append(
            (
                bisect.bisect_right(ends, m.first_scheduled_time) + 1,
                bisect.bisect_left(ends, m.finish_time) + 1,
            )
        )
    return spans


def batching_timeline(runs: Sequence[tuple[str, SimulationResult]]) -> Figure:
    """Requests over engine steps for each (label, run) of one trace: a bar from a request's first step to its
    last, a dotted line while it waits; each panel's step count and mean sequences per step from its stats."""
    n = len(runs[0][1].requests)
    if any(len(r.requests) != n for _, r in runs):
        raise ValueError("the runs must replay the same trace")
    longest = max(len(r.step_stats) for _, r in runs)
    panel_h = 0.3 * n + 0.2
    height = 0.3 + len(runs) * (0.25 + panel_h) + (len(runs) - 1) * 0.6 + 0.9
    fig = Figure(figsize=(WIDTH_INCHES, height))
    y = height - 0.3
    for k, (label, result) in enumerate(runs):
        mean_running = sum(s.num_running for s in result.step_stats) / len(result.step_stats)
        fig.text(
            0.1 / WIDTH_INCHES,
            y / height,
            f"{label}: {len(result.step_stats)} steps, {mean_running:.1f} sequences a step on average",
            fontsize=TITLE_PT,
            weight="bold",
            va="center",
            gid=f"panel-{k}",
        )
        bottom = y - 0.25 - panel_h
        ax = fig.add_axes(
            (0.6 / WIDTH_INCHES, bottom / height, (WIDTH_INCHES - 0.8) / WIDTH_INCHES, panel_h / height)
        )
        spans = request_steps(result)
        for i, (start, end) in enumerate(spans):
            face, hatch = FILLS[i % len(FILLS)]
            ax.broken_barh(
                [(start - 0.5, end - start + 1)],
                (i - 0.35, 0.7),
                facecolors=_light(face),
                hatch=hatch,
                edgecolor="#333333",
                linewidth=0.6,
            )
            if start > 1:
                ax.plot([0.5, start - 0.5], [i, i], color="#555555", lw=1.0, ls=":")
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_xlim(0.5, longest + 0.5)
        ax.set_xticks(range(2, longest + 1, 2))
        ax.grid(axis="x", alpha=0.3)
        ax.set_yticks(range(n), [f"R{i + 1}" for i in range(n)], fontsize=MIN_FONT_PT)
        ax.tick_params(axis="x", labelsize=MIN_FONT_PT)
        ax.spines[["top", "right"]].set_visible(False)
        if k == len(runs) - 1:
            ax.set_xlabel("engine step", fontsize=MIN_FONT_PT)
        y = bottom - 0.6
    fig.text(
        0.1 / WIDTH_INCHES,
        0.2 / height,
        "bar: running (prefill, then a token a step); dotted: waiting",
        fontsize=MIN_FONT_PT,
        va="center",
    )
    return fig


# --- 6. Tensor parallelism -----------------------------------------------------------------------------------


def tp_heads(kv_heads: int, plans: Sequence[tuple[int, int]], title: str) -> Figure:
    """KV heads on each GPU of each (tp, copies) plan: `kvlab.experiments.parallel.kv_head_range` for the heads of every
    rank, `copies` as `kvlab.experiments.parallel.placement(...).kv_copies` gives it; `title` names the model."""
    from kvlab.experiments.parallel import kv_head_range

    fig, ax = _canvas(3.9)
    _text(ax, 0.1, 3.7, title, size=TITLE_PT, weight="bold")
    width = (WIDTH_INCHES - 0.2 - 0.3 * (len(plans) - 1)) / len(plans)
    x_panel = 0.1
    for tp, copies in plans:
        cols = min(4, math.ceil(math.sqrt(tp)))
        rows = cdiv(tp, cols)
        cell_w, cell_h = width / cols, min(0.7, 2.7 / rows)
        what = "each head on one GPU" if copies == 1 else f"each head on {copies} GPUs"
        _text(ax, x_panel, 3.35, f"TP={tp}: {what}", gid=f"plan-{tp}")
        for rank in range(tp):
            heads = kv_head_range(kv_heads, tp, rank)
            r, c = divmod(rank, cols)
            x, y = x_panel + c * cell_w, 3.05 - (r + 1) * cell_h
            face, hatch = FILLS[heads[0] % len(FILLS)]
            _box(ax, x + 0.03, y + 0.03, cell_w - 0.06, cell_h - 0.06, _light(face), hatch)
            names = ", ".join(str(h) for h in heads)
            label = f"head {names}" if len(heads) == 1 else f"heads {names}"
            _label(
                ax,
                x + cell_w / 2,
                y + cell_h * 0.68,
                f"GPU {rank}",
            )
            _label(
                ax,
                x + cell_w / 2,
                y + cell_h * 0.3,
                label,
                gid=f"tp{tp}-rank{rank}",
            )
        x_panel += width + 0.3
    return fig


# --- the registry --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diagram:
    name: str  # book/diagrams/<name>.svg
    chapter: str  # the page that shows it: book/<chapter>/index.md
    alt: str
    draw: Callable[[], Figure]

    def build(self) -> Figure:
        """The diagram drawn under matplotlib's defaults, so the bytes do not depend on what ran before (a lab's
        or a test's figure style left in rcParams)."""
        with mpl.rc_context():
            mpl.rcdefaults()
            return self.draw()


MODEL = "meta-llama/Llama-3.1-8B"
GPU = "H100-SXM"


def _cache_contents() -> Figure:
    from kvlab.specs.shape import shape
    from kvlab.specs.sizing import kv_bytes_per_token

    return cache_contents(shape(MODEL), kv_bytes_per_token(MODEL))


def _budget_stack() -> Figure:
    from kvlab.costs.budget import memory_budget

    return budget_stack(
        memory_budget(MODEL, GPU), f"{MODEL.split('/')[-1]} in bf16 on one {GPU}, vLLM defaults"
    )


def paged_state() -> tuple[BlockManager, list[Request]]:
    """A 16-block pool after a few steps: A, D and B admitted, D freed (its full block stays cached), C admitted
    into D's freed blocks, A decoding three tokens."""
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)

    def admit(request_id: str, length: int, first: int) -> Request:
        seq = Request(list(range(first, first + length)), request_id=request_id)
        admit_whole(manager, seq)
        return seq

    a, d, b = admit("A", 10, 100), admit("D", 7, 200), admit("B", 6, 300)
    manager.free(d)
    c = admit("C", 9, 400)
    for token in range(3):
        a.token_ids.append(900 + token)
        assert manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    return manager, [a, b, c]


def _block_table() -> Figure:
    return block_table(*paged_state())


def shared_prompts() -> tuple[BlockManager, list[Admission]]:
    """Two prompts sharing two blocks, the second diverging in its third, and the first's 12 tokens sent again."""
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = [11, 42, 7, 19, 5, 23, 31, 8, 14, 2, 60, 9, 17, 3]
    second = first[:9] + [77, 60, 9, 21, 6, 40, 13]
    return manager, admit_in_order(manager, [("A", first), ("B", second), ("C", first[:12])])


def _hash_chain() -> Figure:
    return hash_chain(*shared_prompts())


def batching_runs() -> list[tuple[str, SimulationResult]]:
    """One trace of 8 requests arriving at once, 4 sequences at most, each step one virtual second."""
    from kvlab.costs.workloads import TraceRequest
    from kvlab.planning.simulate import LinearStepCost, simulate

    outputs = [9, 3, 5, 8, 2, 10, 4, 6]
    trace = [TraceRequest(0.0, tuple(range(10 * i, 10 * i + 6)), n) for i, n in enumerate(outputs)]
    cost = LinearStepCost(overhead_s=1.0)
    return [
        (mode, simulate(trace, cost, num_blocks=64, block_size=4, max_num_seqs=4, scheduling=mode))
        for mode in ("static", "continuous")
    ]


def _batching() -> Figure:
    return batching_timeline(batching_runs())


def _tp_heads() -> Figure:
    from kvlab.experiments.parallel import placement
    from kvlab.specs.shape import shape

    kv_heads = shape(MODEL).spec.kv_heads
    plans = [(tp, placement(MODEL, context=1, tp=tp).kv_copies) for tp in (4, 16)]
    return tp_heads(
        kv_heads, plans, f"{MODEL.split('/')[-1]}'s {kv_heads} KV heads over tensor-parallel GPUs"
    )


DIAGRAMS: dict[str, Diagram] = {
    d.name: d
    for d in (
        Diagram(
            "cache_contents",
            "01_cache_contents",
            "Layers by K and V by KV heads by tokens, and the hidden state",
            _cache_contents,
        ),
        Diagram(
            "memory_budget",
            "05_active_tokens",
            "One GPU's memory as a stacked bar of budget terms",
            _budget_stack,
        ),
        Diagram(
            "block_table",
            "07_paging",
            "Block tables of three sequences and the physical block pool",
            _block_table,
        ),
        Diagram(
            "continuous_batching",
            "08_continuous_batching",
            "Requests over engine steps, static and continuous",
            _batching,
        ),
        Diagram(
            "hash_chain", "09_prefix_caching", "Chained block hashes of prompts sharing a prefix", _hash_chain
        ),
        Diagram("tp_heads", "13_many_gpus", "KV heads split over 4 GPUs and copied over 16", _tp_heads),
    )
}


def svg_bytes(fig: Figure) -> bytes:
    """The figure as SVG with its text kept as text, the same bytes on every run."""
    buffer = io.BytesIO()
    with mpl.rc_context():
        mpl.rcdefaults()
        mpl.rcParams.update(SVG_RC)
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    return buffer.getvalue()


def save_svg(fig: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(svg_bytes(fig))
