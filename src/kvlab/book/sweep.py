"""`kvlab sweep LAB.ipynb --grid kv_heads=1,2,4 --out DIR`: papermill over a parameter grid, one CSV of results.

Each grid point runs the lab once with papermill and leaves two files under DIR/runs/: the executed notebook and
a JSON record (its parameters, status, and the scalars the lab glued). The record is written last, atomically,
so its presence means the point is done: a rerun skips it, and an interrupt loses at most the points in flight.
DIR/results.csv is rebuilt from the records after every point, one row per grid point. `--jobs N` runs up to N
points at once, each in a worker process with one GPU of its own where there are GPUs; the parent alone writes
the records and the CSV. A worker that dies (killed, or out of memory) takes the points in flight with it: each of
them runs again alone, and the one whose worker dies alone is recorded failed; the sweep goes on.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import csv
import hashlib
import importlib.util
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# myst_nb.glue, like scrapbook before it, stores each value's repr under this mime type in a cell output
GLUE_MIME = "application/papermill.record/text/plain"
RESULTS = "results.csv"
_UNREADABLE = object()  # a repr that is not a literal: a figure, a table
INSTALL_HINT = 'kvlab sweep needs papermill, tqdm and ipykernel: pip install "kvlab[sweep]"'


class SweepError(ValueError):
    """Bad input to a sweep; the command line prints it as one line."""


# ---------------------------------------------------------------------------------------------------------------
# Reading the lab: its parameters and what it glued.


def notebook_parameters(notebook: Path) -> dict[str, Any]:
    """Names and default values of the notebook's `parameters` cell (a default that is not a literal stays text).

    Read with Python's own parser, as papermill's kernel will run the cell: papermill's `inspect_notebook` reads
    it line by line, skips (with a warning) a line whose comment holds an `=`, and so would lose that parameter.
    """
    if not notebook.is_file():
        raise SweepError(f"no such notebook: {notebook}")
    try:
        cells = json.loads(notebook.read_text())["cells"]
        source = next(
            "".join(cell["source"])
            for cell in cells
            if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", [])
        )
    except StopIteration:
        raise SweepError(f"{notebook} has no cell tagged `parameters`") from None
    except (ValueError, KeyError, TypeError) as err:
        raise SweepError(f"cannot read the parameters of {notebook}: {_one_line(err)}") from None
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise SweepError(f"cannot read the parameters of {notebook}: {_one_line(err)}") from None
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            text = ast.get_source_segment(source, node.value) or ""
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = _literal(text, text)
    if not found:
        raise SweepError(f"{notebook} has no cell tagged `parameters`")
    return found


def glued_scalars(notebook: Path | dict) -> dict[str, Any]:
    """The numbers, strings and booleans a notebook glued, by name; figures and tables are left out."""
    nb = json.loads(notebook.read_text()) if isinstance(notebook, Path) else notebook
    values = {}
    for cell in nb.get("cells", []):
        for output in cell.get("outputs", []):
            text = output.get("data", {}).get(GLUE_MIME)
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            if text is None or name is None:
                continue
            text = "".join(text) if isinstance(text, list) else text
            # numpy 2 writes scalars as np.float64(1.5): keep what is inside
            inner = re.fullmatch(r"np\.\w+\((.*)\)", text.strip(), re.S)
            value = _literal(inner.group(1) if inner else text, _UNREADABLE)
            if value is None or isinstance(value, (bool, int, float, str)):
                values[name] = value
    return values


# ---------------------------------------------------------------------------------------------------------------
# Parsing the command line's `name=value` and `name=v1,v2` against the notebook's defaults.


def parse_value(name: str, text: str, default: Any) -> Any:
    """`text` read with the type of the parameter's default (int, float, bool, str, list, ...; None: a literal)."""
    if isinstance(default, bool):
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
    elif isinstance(default, str):
        return _text_or_number(text)
    elif isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            pass
    elif isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            pass
    elif default is None:
        return _literal(text, text)  # None means "anything": 3 is an int, abc a string
    else:  # list, tuple, dict: a Python literal of the same kind
        value = _literal(text, None)
        if isinstance(value, type(default)):
            return value
    kind = type(default).__name__
    raise SweepError(
        f"cannot read {text!r} as the {kind} that parameter {name!r} takes (default {default!r})"
    )


def _text_or_number(text: str) -> str | int | float:
    """A value for a parameter whose default is a string, read as papermill's `-y` (YAML) reads a scalar: a bare
    number is a number (`weight_dtype=4` means 4-bit weights, which a lab takes as an int), a quoted value stays a
    string (`name="4"`), anything else is the text itself (`bf16`; `yes` and `null` too, unlike YAML)."""
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    if re.fullmatch(r"[+-]?\d+", stripped):
        return int(stripped)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+(?=[eE]))([eE][+-]?\d+)?", stripped):
        return float(stripped)
    return text


def split_values(text: str) -> list[str]:
    """'1,2,4' -> ['1', '2', '4']; commas inside brackets or quotes stay: '[8,64],[16]' -> ['[8,64]', '[16]']."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[({":
            depth += 1
        elif char in "])}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part.strip() for part in parts]


def parse_assignments(
    specs: list[str], defaults: dict[str, Any], *, many: bool, flag: str
) -> dict[str, Any | list[Any]]:
    """`--grid name=v1,v2` (many=True: a list per name) or `-p name=value`, checked against the notebook."""
    parsed: dict[str, Any] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise SweepError(f"{flag} expects name=value{'s' if many else ''}, got {spec!r}")
        if name not in defaults:
            raise SweepError(
                f"unknown parameter {name!r}; the notebook's parameters are: {', '.join(defaults)}"
            )
        if name in parsed:
            raise SweepError(f"parameter {name!r} is given twice")
        if many:
            texts = split_values(text)
            if not text.strip() or not all(texts):
                raise SweepError(f"{flag} {spec!r} has an empty value; give e.g. {name}=1,2,4")
            values = [parse_value(name, t, defaults[name]) for t in texts]
            parsed[name] = _unique(values)
        else:
            parsed[name] = parse_value(name, text, defaults[name])
    return parsed


# ---------------------------------------------------------------------------------------------------------------
# Running the grid.


@dataclass
class Sweep:
    notebook: Path
    grid: dict[str, list[Any]]  # axes in command-line order; the first is the plot's default x
    fixed: dict[str, Any] = field(default_factory=dict)
    out: Path = Path("sweep")
    kernel: str | None = None  # None: the kernel the notebook names

    def points(self) -> list[dict[str, Any]]:
        names = list(self.grid)
        return [dict(zip(names, values, strict=True)) for values in itertools.product(*self.grid.values())]

    @property
    def runs(self) -> Path:
        return self.out / "runs"


@dataclass
class Outcome:
    rows: list[dict[str, Any]]  # one per grid point, in grid order: parameters, status, error, glued scalars
    ran: int
    skipped: int
    failed: int
    csv: Path


def point_name(point: dict[str, Any]) -> str:
    """A file name for a grid point: readable when it can be, made unique by a hash when not."""
    text = ",".join(f"{k}={v}" for k, v in point.items())
    safe = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    if safe == text and len(safe) <= 120:
        return safe
    return f"{safe[:100]}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


def load_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or torn: the point is not done


# What a point's record says when the worker process running it died (killed, or out of memory)
WORKER_DIED = "its worker process died (killed, or out of memory) while it ran"


def point_record(
    sweep: Sweep, point: dict[str, Any], status: str, error: str = "", values: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A point's record: its parameters, where its executed notebook goes, and how it ended ("ok" or "failed",
    which runs again at the next sweep)."""
    return {
        "point": point,
        "parameters": {**sweep.fixed, **point},
        "notebook": str(sweep.runs / f"{point_name(point)}.ipynb"),
        "status": status,
        "error": error,
        "values": values or {},
    }


def run_point(sweep: Sweep, point: dict[str, Any]) -> dict[str, Any]:
    """Execute the notebook at one point; a failure becomes a record, never an exception (except an interrupt)."""
    papermill = _require("papermill")
    parameters = {**sweep.fixed, **point}
    executed = sweep.runs / f"{point_name(point)}.ipynb"
    try:
        with _parameters_checked():
            papermill.execute_notebook(
                str(sweep.notebook),
                str(executed),
                parameters=parameters,
                cwd=str(sweep.notebook.resolve().parent),  # labs read files next to themselves
                kernel_name=sweep.kernel,
                progress_bar=False,
            )
    except Exception as err:
        return point_record(sweep, point, "failed", _one_line(err))
    return point_record(sweep, point, "ok", values=glued_scalars(executed))


def run_sweep(sweep: Sweep, *, progress: bool = True, jobs: int = 1) -> Outcome:
    """Run every grid point not already done, up to `jobs` at once; rewrite the CSV after each, so an interrupt
    loses nothing finished."""
    jobs = parse_jobs(jobs)
    tqdm = _require("tqdm").tqdm
    sweep.runs.mkdir(parents=True, exist_ok=True)
    points = sweep.points()
    records: list[dict[str, Any] | None] = []
    for point in points:
        old = load_record(sweep.runs / f"{point_name(point)}.json")
        same = old is not None and old.get("parameters") == _jsonable({**sweep.fixed, **point})
        records.append(old if same else None)  # a record of other -p values is not this point's
    # Failed points run again (their old record stays in the CSV until then); finished ones never do.
    todo = [i for i, record in enumerate(records) if record is None or record.get("status") != "ok"]
    ran = failed = 0
    bar = tqdm(total=len(points), initial=len(points) - len(todo), unit="point", disable=not progress)

    def finish(i: int, record: dict[str, Any]) -> None:
        nonlocal ran, failed
        _atomic_write(sweep.runs / f"{point_name(points[i])}.json", json.dumps(record, indent=1))
        records[i] = record
        ran += 1
        failed += record["status"] != "ok"
        write_csv(sweep, records)
        bar.update()

    try:
        if jobs == 1:
            for i in todo:
                bar.set_postfix_str(point_name(points[i]))
                finish(i, _jsonable(run_point(sweep, points[i])))
        elif todo:
            _run_parallel(sweep, [(i, points[i]) for i in todo], jobs, finish, bar, progress)
    finally:
        bar.close()
        write_csv(sweep, records)
    rows = [_row(r) for r in records if r is not None]
    return Outcome(rows, ran, len(points) - len(todo), failed, sweep.out / RESULTS)


# ---------------------------------------------------------------------------------------------------------------
# Several points at once (`--jobs N`): worker processes, one GPU each.


def parse_jobs(value: str | int) -> int:
    """`--jobs N`: how many grid points run at once, a whole number of at least 1."""
    try:
        jobs = int(value)
    except (TypeError, ValueError):
        raise SweepError(f"--jobs takes a whole number of points to run at once, got {value!r}") from None
    if jobs < 1:
        raise SweepError(f"--jobs must be at least 1, got {jobs}")
    return jobs


def gpu_count() -> int:
    """The GPUs this process may use: torch's count where torch imports, else `nvidia-smi -L`'s, else 0."""
    try:
        import torch
    except ImportError:
        pass
    else:
        # NVML's count where it works, so the parent never initialises CUDA before forking its workers
        return torch.cuda.device_count()
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # nvidia-smi lists every GPU in the machine; CUDA, and so the lab, sees only those the variable names
    return count if visible is None else min(count, len(_device_ids(visible)))


def worker_devices(workers: int, n_gpus: int, environ: Mapping[str, str]) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each worker slot; None leaves the variable as the user has it.

    With GPUs, slot i gets GPU i mod n_gpus: the id the user's CUDA_VISIBLE_DEVICES gives it where that is set
    (`CUDA_VISIBLE_DEVICES=2,3 kvlab sweep --jobs 2` runs on GPUs 2 and 3), else its index. Without GPUs, an
    empty value where the variable is unset, so no lab looks for one; a value the user set is left alone.
    """
    if n_gpus > 0:
        ids = _device_ids(environ.get("CUDA_VISIBLE_DEVICES", ""))[:n_gpus] or [str(i) for i in range(n_gpus)]
        return [ids[slot % len(ids)] for slot in range(workers)]
    return [None if "CUDA_VISIBLE_DEVICES" in environ else ""] * workers


def _device_ids(visible: str) -> list[str]:
    return [part.strip() for part in visible.split(",") if part.strip()]


def _run_parallel(
    sweep: Sweep,
    todo: list[tuple[int, dict[str, Any]]],
    jobs: int,
    finish: Callable[[int, dict[str, Any]], None],
    bar: Any,
    progress: bool,
) -> None:
    """Run `todo` (grid index, point) in up to `jobs` worker processes, calling `finish` here, in the parent, for
    each point as it ends: records and the CSV have one writer."""
    workers = min(jobs, len(todo))
    n_gpus = gpu_count()
    devices = worker_devices(workers, n_gpus, os.environ)
    if workers > n_gpus > 0:
        bar.write(f"kvlab: {workers} jobs on {n_gpus} GPU{'s' * (n_gpus > 1)}: several jobs share a GPU")
    waiting, points = collections.deque(todo), dict(todo)
    # Points in flight when a worker died: each runs again alone, so the one that kills its worker is known.
    suspects: collections.deque[int] = collections.deque()
    running: dict[Future[dict[str, Any]], tuple[int, int]] = {}  # future: its grid index, its worker slot
    free = list(range(workers))
    # fork: a worker starts without importing kvlab again, the same on every Python (3.14 defaults to
    # forkserver); macOS's system libraries are not fork-safe, so there it spawns
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")

    def new_pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(workers, mp_context=context, initializer=_ignore_interrupts)

    pool = new_pool()
    solo = False  # a suspect is running, alone
    try:
        while waiting or suspects or running:
            # A point starts only when a slot is free, so no two points in flight share a slot's GPU; a suspect
            # starts only on an idle pool and runs alone.
            solo = solo and bool(running)
            if suspects and not running:
                i, slot, solo = suspects.popleft(), free.pop(0), True
                running[pool.submit(_run_in_slot, sweep, points[i], devices[slot])] = (i, slot)
            while waiting and free and not suspects and not solo:
                slot = free.pop(0)
                i, point = waiting.popleft()
                running[pool.submit(_run_in_slot, sweep, point, devices[slot])] = (i, slot)
            bar.set_postfix_str(f"{len(running)} running")
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            interrupted: BaseException | None = None
            died = False
            for future in sorted(done, key=lambda f: running[f][0]):
                error = future.exception()
                if isinstance(error, BrokenProcessPool):
                    died = True
                    continue
                i, slot = running.pop(future)
                free.append(slot)
                if error is not None:
                    # run_point records a lab's failure, so this is an interrupt
                    interrupted = interrupted or error
                    continue
                record = future.result()
                bar.set_postfix_str(f"{len(running)} running", refresh=False)
                finish(i, record)
                # One line per point, above the bar: with several in flight, the bar's postfix cannot name them.
                if progress:
                    bar.write(f"{record['status']}: {point_name(points[i])}")
            if interrupted is not None:
                raise interrupted
            if died:
                # The pool is broken and every point in flight is lost with it: a point that was alone killed
                # its worker and is recorded failed; the others run again alone, on a new pool.
                lost = sorted(i for i, _ in running.values())
                free = list(range(workers))
                running.clear()
                pool.shutdown(wait=True, cancel_futures=True)
                pool = new_pool()
                if len(lost) == 1:
                    record = _jsonable(point_record(sweep, points[lost[0]], "failed", WORKER_DIED))
                    finish(lost[0], record)
                    if progress:
                        bar.write(f"failed: {point_name(points[lost[0]])} ({WORKER_DIED})")
                else:
                    suspects.extend(lost)
    except BaseException:
        # Start nothing more. Ctrl-C has reached the points in flight as well, so they end soon; keep any that
        # finished all the same, as a one-point-at-a-time sweep keeps every point it finished.
        pool.shutdown(wait=True, cancel_futures=True)
        for future, (i, _) in sorted(running.items(), key=lambda item: item[1][0]):
            if not future.cancelled() and future.exception() is None:
                finish(i, future.result())
        raise
    pool.shutdown()


def _ignore_interrupts() -> None:
    """A worker between points ignores Ctrl-C, which the parent handles; otherwise it would die with a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_in_slot(sweep: Sweep, point: dict[str, Any], device: str | None) -> dict[str, Any]:
    """`run_point` in a worker, under its slot's GPU: papermill starts the kernel with this process's environment
    (jupyter_client copies os.environ when it launches one), so setting the variable here is enough."""
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    # Ctrl-C stops the point in flight, as it does one point at a time; run_point lets KeyboardInterrupt through.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _jsonable(run_point(sweep, point))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def write_csv(sweep: Sweep, records: list[dict[str, Any] | None]) -> Path:
    """results.csv: the grid axes, status and error, then every glued scalar (first seen first)."""
    rows = [_row(record) for record in records if record is not None]
    columns = list(dict.fromkeys(key for row in rows for key in row)) or [*sweep.grid, "status", "error"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path = sweep.out / RESULTS
    _atomic_write(path, buffer.getvalue())
    return path


def plot(sweep: Sweep, rows: list[dict[str, Any]], name: str, x: str | None = None) -> Path:
    """One PNG of glued scalar `name` against grid axis `x` (default: the first), one line per other-axes value."""
    x = x or next(iter(sweep.grid))
    if x not in sweep.grid:
        raise SweepError(f"--x {x!r} is not a grid axis; the axes are: {', '.join(sweep.grid)}")
    done = [row for row in rows if row["status"] == "ok"]
    if not done:
        raise SweepError(f"no point finished, so there is nothing to plot for {name!r}")
    if name not in done[0]:
        known = [k for k in done[0] if k not in sweep.grid and k not in ("status", "error")]
        raise SweepError(f"the lab glued no scalar {name!r}; it glued: {', '.join(known)}")
    if any(as_number(row.get(name)) is None for row in done):
        raise SweepError(f"{name!r} is not a number in every run, so it cannot be plotted")
    from kvlab.book import plot as kplot  # matplotlib only when a plot is asked for

    numeric_x = all(as_number(v) is not None and not isinstance(v, str) for v in sweep.grid[x])
    others = [axis for axis in sweep.grid if axis != x]
    from matplotlib.axes import Axes

    fig, ax = kplot.figure()
    assert isinstance(ax, Axes)  # one row, one column: a single Axes
    for key, grouped in itertools.groupby(
        sorted(done, key=lambda r: [repr(r[a]) for a in others]), key=lambda r: [r[a] for a in others]
    ):
        group = list(grouped)
        xs = [row[x] if numeric_x else sweep.grid[x].index(row[x]) for row in group]
        order = sorted(range(len(xs)), key=xs.__getitem__)
        ys = [float(as_number(group[i][name]) or 0.0) for i in order]  # every value was checked above
        label = ", ".join(f"{a}={v}" for a, v in zip(others, key, strict=True)) or None
        ax.plot([xs[i] for i in order], ys, "o-", label=label)
    positive = [v for v in sweep.grid[x] if numeric_x and v > 0]
    if numeric_x and len(positive) == len(sweep.grid[x]) and max(positive) >= 16 * min(positive):
        ax.set_xscale("log", base=2)  # doubling grids (1, 2, 4, ... 64) read best on a log2 axis
    if numeric_x:
        ax.set_xticks(sorted(sweep.grid[x]), [str(v) for v in sorted(sweep.grid[x])])
    else:
        ax.set_xticks(range(len(sweep.grid[x])), [str(v) for v in sweep.grid[x]])
    ax.set_xlabel(x)
    ax.set_ylabel(name)
    ax.set_title(f"{sweep.notebook.parent.name}/{sweep.notebook.name}: {name} against {x}")
    if others:
        ax.legend()
    path = sweep.out / f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.png"
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------
# The command line (cli.py adds the subparser and calls `main`).


def add_arguments(parser) -> None:
    parser.add_argument("notebook", type=Path, help="the lab to run, e.g. book/01_cache_contents/lab.ipynb")
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="an axis of the grid (repeatable); values read with the type of the parameter's default",
    )
    parser.add_argument(
        "-p", dest="fixed", action="append", default=[], metavar="NAME=VALUE", help="a fixed parameter"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for results.csv, runs/ and the plot")
    parser.add_argument("--plot", metavar="NAME", help="plot this glued scalar against a grid axis")
    parser.add_argument("--x", metavar="AXIS", help="the plot's x axis (default: the first --grid)")
    parser.add_argument("--kernel", help="Jupyter kernel (default: the one the notebook names)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--jobs",
        default="1",
        metavar="N",
        help="run up to N grid points at once, each on one GPU of its own where there are GPUs (default 1)",
    )


def main(args) -> int:
    """Run `kvlab sweep`; bad input raises SweepError (exit 2), failed points give exit 1."""
    jobs = parse_jobs(args.jobs)
    sweep = build(args.notebook, args.grid, args.fixed, args.out, kernel=args.kernel)
    if importlib.util.find_spec("ipykernel") is None and args.kernel is None:
        raise SweepError(INSTALL_HINT)  # otherwise every point would fail on a missing kernel
    if args.x and args.x not in sweep.grid:
        raise SweepError(f"--x {args.x!r} is not a grid axis; the axes are: {', '.join(sweep.grid)}")
    stored = glued_scalars(sweep.notebook)  # labs are committed with outputs: check --plot before running
    if args.plot and stored and args.plot not in stored:
        raise SweepError(f"the lab glues no scalar {args.plot!r}; it glues: {', '.join(stored)}")
    if args.plot in stored and as_number(stored[args.plot]) is None:
        raise SweepError(f"--plot {args.plot!r} is not a number (the lab glues {stored[args.plot]!r})")
    try:
        outcome = run_sweep(sweep, progress=not args.no_progress, jobs=jobs)
    except KeyboardInterrupt:
        print(f"kvlab: interrupted; finished points are in {sweep.out / RESULTS}; rerun to resume")
        return 130
    print(
        f"{len(outcome.rows)} points: {outcome.ran} run, {outcome.skipped} already done, "
        f"{outcome.failed} failed -> {outcome.csv}"
    )
    for row in outcome.rows:
        if row["status"] != "ok":
            point = ", ".join(f"{a}={row[a]}" for a in sweep.grid)
            print(f"failed: {point}: {row['error']}")
    if args.plot:
        print(f"plot: {plot(sweep, outcome.rows, args.plot, args.x)}")
    return 1 if outcome.failed else 0


def build(notebook: Path, grid: list[str], fixed: list[str], out: Path, kernel: str | None = None) -> Sweep:
    """Check the command line against the notebook and return the sweep it asks for."""
    notebook = Path(notebook)
    defaults = notebook_parameters(notebook)
    if not grid:
        raise SweepError("the grid is empty; give at least one --grid NAME=V1,V2")
    axes = parse_assignments(grid, defaults, many=True, flag="--grid")
    constants = parse_assignments(fixed, defaults, many=False, flag="-p")
    both = set(axes) & set(constants)
    if both:
        raise SweepError(f"{', '.join(sorted(both))} is both a --grid axis and a -p parameter")
    return Sweep(notebook, axes, constants, Path(out), kernel)


# ---------------------------------------------------------------------------------------------------------------
# Helpers.


class _CheckedParameters(logging.Filter):
    """Drops papermill's own reading of the parameters cell (`Unable to parse line ...`, `Passed unknown
    parameter ...`): `notebook_parameters` has read that cell with Python's parser and `build` checked every
    name against it, so these warnings would only repeat, or contradict, a check kvlab made."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Unable to parse line", "Passed unknown parameter"))


@contextlib.contextmanager
def _parameters_checked() -> Iterator[None]:
    loggers = [logging.getLogger("papermill"), logging.getLogger("papermill.translators")]
    quiet = _CheckedParameters()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _require(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise SweepError(INSTALL_HINT) from None


def _literal(text: str, fallback: Any) -> Any:
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return fallback


def _unique(values: list[Any]) -> list[Any]:
    seen, kept = set(), []
    for value in values:
        if repr(value) not in seen:
            seen.add(repr(value))
            kept.append(value)
    return kept


def as_number(value: Any) -> float | None:
    """A plottable number: glued ints and floats, and the strings labs format for prose ('1,025', '0.0001')."""
    if isinstance(value, str):
        value = _literal(value.replace(",", "").replace("_", ""), None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _jsonable(value: Any) -> Any:
    """Tuples become lists, as they will after a JSON round trip, so stored and new parameters compare equal."""
    return json.loads(json.dumps(value))


def _row(record: dict[str, Any]) -> dict[str, Any]:
    return {**record["point"], "status": record["status"], "error": record["error"], **record["values"]}


def _one_line(err: Exception) -> str:
    ename, evalue = getattr(err, "ename", None), getattr(err, "evalue", None)  # PapermillExecutionError
    text = f"{ename}: {evalue}" if ename else f"{type(err).__name__}: {err}"
    return " ".join(text.split())[:500]


def _atomic_write(path: Path, text: str) -> None:
    """Write beside the target, then rename over it: a reader sees the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
