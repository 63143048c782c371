"""Small, dependency-free tables for notebooks: HTML in the book, aligned text in diffs and nbval."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.agreement import Agreement
    from kvlab.costs.budget import MemoryBudget


@dataclass
class Table:
    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str = ""

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"row {row!r} has {len(row)} cells for {len(self.columns)} columns")

    def _cells(self) -> list[list[str]]:
        return [[_fmt(value) for value in row] for row in self.rows]

    def formatted_rows(self) -> list[list[str]]:
        """The rows as the table prints them (thousands separators, 3 significant digits)."""
        return self._cells()

    def __repr__(self) -> str:
        cells = [list(self.columns), *self._cells()]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        lines = [
            "  ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in cells
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(([self.caption] if self.caption else []) + lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self._cells()
        )
        caption = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        return (
            f'<table class="kvlab-table">{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
        )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, tuple):
        return "(" + ", ".join(str(v) for v in value) + ")"
    return str(value)


# --- The numbers a chapter reads from its lab --------------------------------------------------------------------


def glue_all(values: Mapping[str, Any], *, prefix: str = "") -> None:
    """Glue every value of `values` for the chapter's `{glue}` roles, under `prefix` + its key, in their order.

    One call per cell instead of one `glue()` line per number. Values are stored, not displayed, exactly as
    `myst_nb.glue(name, value, display=False)` stores them, so the notebook's outputs are the same either way."""
    from myst_nb import glue

    for key, value in values.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"glue name must be an identifier, got {key!r}")
        if hasattr(value, "savefig"):
            # Stored without display, a figure's image never reaches the built page (its file is not written).
            raise ValueError(f"glue figure {key!r} with myst_nb.glue(name, fig), which displays it too")
        glue(prefix + key, value, display=False)


# --- Greedy agreement that a near-tie cannot flip ----------------------------------------------------------------


def budget_table(plan: MemoryBudget, caption: str = "") -> Table:
    """A memory budget term by term, as chapter 5 shows it: the capacity, every term taken before the pool (the
    rule's own, `MemoryBudget.stack`), the block rounding and the pool, expected and floor."""
    from kvlab.units import format_bytes

    rows: list[tuple[str, str, str]] = [
        ("capacity", format_bytes(plan.capacity_bytes), "what the driver (nvidia-smi) reports")
    ]
    rows += [(f"− {name}", format_bytes(value), note) for name, value, note in plan.stack() if value]
    if plan.fits:
        rows += [
            (
                "− block rounding",
                format_bytes(plan.rounding_bytes),
                f"whole blocks of {plan.block_size} tokens",
            ),
            (
                "= KV pool (expected)",
                format_bytes(plan.kv_pool_bytes),
                f"{plan.num_blocks:,} blocks: {plan.max_tokens():,} tokens",
            ),
        ]
        if plan.floor is not None:
            rows.append(
                (
                    "KV pool floor",
                    format_bytes(plan.kv_pool_floor_bytes),
                    f"{plan.floor.max_tokens():,} tokens, every estimate at its bound",
                )
            )
    else:
        rows.append(("= KV pool", "none", "the terms above exceed the capacity"))
    return Table(["term", "bytes", "what it is"], rows, caption=caption)


def tokens_kept(agreement: Agreement) -> int:
    """Tokens before the first difference (all compared tokens when the two sequences are identical).

    Past a first difference the two continuations are different texts, so positions there are not counted."""
    return agreement.length if agreement.first_difference is None else agreement.first_difference


def share_kept(agreements: Sequence[Agreement]) -> float:
    """Share of all compared tokens that come before each pair's first difference (1.0 when nothing compared)."""
    total = sum(a.length for a in agreements)
    return sum(tokens_kept(a) for a in agreements) / total if total else 1.0


def keeps_tokens(agreement: Agreement, threshold: float) -> bool:
    """Whether a quantized (or otherwise perturbed) generation keeps the reference's greedy tokens.

    True when at least `threshold` of the compared tokens come before the first difference, or when that first
    difference is a near-tie (`Agreement.close`: each side's token among the other side's top-k lists the
    agreement was built from; top-2 lists make it a swap of the two best tokens). A near-tie is where a last-bit
    difference in the logits, as another CPU's kernels give, can flip the greedy choice: an assert on the share
    alone would then fail on a machine where the claim holds."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    return tokens_kept(agreement) >= threshold * agreement.length or agreement.close


# --- Results of `make gpu` (kvlab.book.gpu), shown beside a chapter's CPU figures ----------------------------------

NO_GPU_RUN = "no GPU run is recorded yet"


def find_results(start: Path | None = None) -> Path | None:
    """book/results above `start` (default: the working directory, a chapter's folder when a lab runs)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "results" if folder.name == "book" else folder / "book" / "results"
        if candidate.is_dir():
            return candidate
    return None


def gpu_results(chapter: str, results: str | Path | None = None) -> list[dict[str, Any]]:
    """Every recorded `make gpu` run of `chapter` (its folder name, e.g. '04_bandwidth_bound'), by GPU folder."""
    root = Path(results) if results is not None else find_results()
    if root is None or not root.is_dir():
        return []
    records = []
    for path in sorted(root.glob(f"*/{chapter}.json")):
        if path.parent.name == "cpu-stub":
            continue  # a dry run on CPU is not a GPU measurement
        record = json.loads(path.read_text())
        record["gpu_folder"] = path.parent.name
        records.append(record)
    return records


def gpu_provenance(record: dict[str, Any]) -> str:
    """One recorded run's provenance in a line: GPU, driver, CUDA, torch, transformers, kvlab and its commit, date
    (and the error of a failed run)."""
    p = record.get("provenance", {})
    commit = str(p.get("kvlab_commit", "unknown"))[:12]
    status = "" if record.get("status") == "ok" else f"; run FAILED: {record.get('error', '')}"
    machine = (
        f"compute capability {p.get('compute_capability', '?')}, driver {p.get('driver', '?')}, "
        f"CUDA {p.get('cuda', '?')}"
    )
    host = (
        f"host {p.get('cpu', '?')} ({p.get('cpu_capability', '?')}), {p.get('threads', '?')} torch threads, "
        f"load average {p.get('load_average', '?')} at the start"
    )
    return (
        f"{p.get('device', record.get('gpu_folder', '?'))}: {machine}; {host}; "
        f"torch {p.get('torch', '?')}, transformers {p.get('transformers', '?')}, kvlab {p.get('kvlab', '?')} "
        f"(commit {commit}), {p.get('date', '?')}{status}"
    )


def gpu_results_table(
    chapter: str,
    results: str | Path | None = None,
    keys: Sequence[str] | None = None,
    cpu: Mapping[str, Any] | None = None,
) -> Table:
    """The chapter's glued scalars as measured on each recorded GPU, one column per GPU, with each run's
    provenance in the caption; a one-row table saying no GPU run is recorded yet when there is none.

    `cpu`, when given (e.g. `kvlab.book.sweep.glued_scalars` of the lab's stored outputs), adds the CPU values as the
    first column of values, beside the GPU ones."""
    records = gpu_results(chapter, results)
    if not records:
        return Table(
            ["measured on a GPU"],
            [
                [
                    f"{NO_GPU_RUN} for {chapter} (`make gpu` on a GPU machine writes book/results/<gpu>/{chapter}.json)"
                ]
            ],
        )
    names = list(keys) if keys is not None else list(dict.fromkeys(k for r in records for k in r["values"]))
    devices = [f"measured on {r['provenance'].get('device', r['gpu_folder'])}" for r in records]
    columns = ["value", *(["CPU (stored lab outputs)"] if cpu is not None else []), *devices]
    rows = [
        [
            name,
            *([cpu.get(name, "")] if cpu is not None else []),
            *(r["values"].get(name, "") for r in records),
        ]
        for name in names
    ]
    if not rows:
        rows = [["(no glued values)", *([""] if cpu is not None else []), *(r["status"] for r in records)]]
    notes = [gpu_provenance(r) for r in records]
    return Table(columns, rows, caption="Recorded GPU runs (make gpu): " + " | ".join(notes))
