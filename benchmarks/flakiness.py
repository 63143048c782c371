"""How often each timing lab fails, quiet and beside a CPU-bound load: a true claim's designed rate, measured.

    .venv/bin/python benchmarks/flakiness.py book/08_continuous_batching book/12_beyond_hbm --runs 20
    .venv/bin/python benchmarks/flakiness.py LAB... --runs 20 --load 1 --json _build/flakiness-loaded.json

Each run executes the whole lab with nbclient (GPU hidden, seeded as in `make nbval`), in turn, `--runs`
times. With `--load K` it first starts K processes that spin on the CPU and stops them at the end, so every
run shares the machine with them. It prints, per lab, the failed runs and the assert each failed at, and per
claim (from the attempt lines `kvlab.claims.measure_claim` prints) how often one attempt missed: with a
per-attempt miss rate p and k attempts, the claim fails about p**k of the runs if attempts miss independently.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError

from kvlab import claims
from kvlab.env import env_report

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    lab: str
    number: int
    seconds: float
    load_average: float
    failed_at: str = ""
    attempts: list[claims.AttemptLine] = field(default_factory=list)
    # The 1-minute load average when the run ended: the load it actually shared the machine with.
    load_after: float = 0.0
    # Shares of the machine's CPU time during the run spent by niced processes (`nice` in /proc/stat) and by
    # everything else: the load average counts niced work as load, though it only takes what the lab leaves idle.
    niced_share: float = 0.0
    busy_share: float = 0.0


def _spin() -> None:
    while True:
        pass


def _lab_path(name: str) -> Path:
    path = Path(name)
    path = path if path.suffix == ".ipynb" else path / "lab.ipynb"
    path = path if path.is_absolute() else ROOT / path
    if not path.is_file():
        raise SystemExit(f"no such lab: {name}")
    return path


def _stream_text(nb: nbformat.NotebookNode) -> str:
    return "".join(
        o.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream"
    )


def _failure(err: CellExecutionError) -> str:
    """The failing assert in one line: the error's own message, else the error's type."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if line.startswith(("AssertionError", "ValueError", "RuntimeError"))]
    return (named[-1] if named else (lines[-1] if lines else "error"))[:200]


def cpu_times() -> list[int]:
    """The aggregate `cpu` line of /proc/stat: user, nice, system, idle, iowait, irq, softirq, steal (ticks)."""
    try:
        with open("/proc/stat") as stat:
            return [int(v) for v in stat.readline().split()[1:9]]
    except OSError:
        return [0] * 8


def cpu_shares(before: list[int], after: list[int]) -> tuple[float, float]:
    """(niced, busy not niced) shares of the CPU time between two `cpu_times` readings."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta) or 1
    niced = delta[1] / total
    idle = (delta[3] + delta[4]) / total
    return niced, 1 - idle - niced


def run_lab(lab: Path, number: int, timeout: int) -> Run:
    nb = nbformat.read(lab, as_version=4)
    load = os.getloadavg()[0]
    ticks = cpu_times()
    start = time.perf_counter()
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(lab.parent)}}
    )
    failed = ""
    try:
        client.execute()
    except CellExecutionError as err:
        failed = _failure(err)
    except (DeadKernelError, TimeoutError, RuntimeError) as err:
        # A kernel that dies or hangs is a failed run too, not the end of the whole sweep.
        failed = f"{type(err).__name__}: {err}".splitlines()[0][:200]
    seconds = time.perf_counter() - start
    name = str(lab.parent.relative_to(ROOT))
    attempts = claims.parse_attempts(_stream_text(nb))
    niced, busy = cpu_shares(ticks, cpu_times())
    return Run(name, number, seconds, load, failed, attempts, os.getloadavg()[0], niced, busy)


def report(runs: list[Run], load: int) -> str:
    lines = [f"flakiness, {'quiet' if not load else f'beside {load} CPU-bound process(es)'}:"]
    lines.append(
        f"{'lab':32} {'runs':>4} {'failed':>6} {'median s':>8} {'load avg':>8} {'niced %':>7}  failed at"
    )
    by_lab: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_lab[run.lab].append(run)
    for lab, done in by_lab.items():
        failures = Counter(r.failed_at for r in done if r.failed_at)
        seconds = sorted(r.seconds for r in done)[len(done) // 2]
        loads = sum((r.load_average + r.load_after) / 2 for r in done) / len(done)
        niced = 100 * sum(r.niced_share for r in done) / len(done)
        where = "; ".join(f"{n}x {what}" for what, n in failures.most_common()) or "-"
        lines.append(
            f"{lab:32} {len(done):>4} {sum(failures.values()):>6} {seconds:>8.0f} {loads:>8.2f} {niced:>7.0f}  {where}"
        )
    lines.append("")
    lines.append(f"{'claim':60} {'attempts':>8} {'missed':>6} {'p':>6} {'k':>2} {'p**k':>8}")
    attempts: dict[tuple[str, str], list[claims.AttemptLine]] = defaultdict(list)
    for run in runs:
        for a in run.attempts:
            attempts[(run.lab, a.claim)].append(a)
    for (lab, claim), seen in attempts.items():
        missed = sum(not a.holds for a in seen)
        p = missed / len(seen)
        k = max(a.of for a in seen)
        lines.append(
            f"{(lab.split('/')[-1] + ': ' + claim)[:60]:60} {len(seen):>8} {missed:>6} {p:>6.2f} {k:>2} {p**k:>8.1e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", help="chapter folders (book/08_continuous_batching) or lab paths")
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print the table of earlier sweeps' JSON files, run nothing",
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes to run beside the labs")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument(
        "--pause-file",
        type=Path,
        help="while this file exists, wait between runs with the load stopped",
    )
    args = parser.parse_args(argv)
    if args.report:
        print(report_files(args.report))
        return 0
    if not args.labs:
        parser.error("name the labs to run, or --report JSON files")
    if args.runs < 1 or args.load < 0:
        parser.error("--runs must be at least 1 and --load at least 0")
    labs = [_lab_path(name) for name in args.labs]
    os.environ.update(
        CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    runs: list[Run] = []
    try:
        for number in range(1, args.runs + 1):
            for lab in labs:
                _wait_while_paused(args.pause_file, spinners)
                run = run_lab(lab, number, args.timeout)
                runs.append(run)
                state = f"FAILED: {run.failed_at}" if run.failed_at else "ok"
                print(f"run {number}/{args.runs} {run.lab}: {state} ({run.seconds:.0f} s)", flush=True)
                # Written after every run, so a sweep cut short still leaves its runs on disk.
                _write(args.json, runs, args.load)
    finally:
        for p in spinners:
            p.terminate()
    print(report(runs, args.load))
    return 0


def _wait_while_paused(pause: Path | None, spinners: list[multiprocessing.Process]) -> None:
    """Hold the sweep between runs, so the machine can be borrowed without a run sharing it."""
    if pause is None or not pause.exists():
        return
    # The load is stopped too: a paused sweep should leave the machine to whoever paused it.
    for p in spinners:
        os.kill(p.pid, signal.SIGSTOP)
    print(f"paused while {pause} exists", flush=True)
    while pause.exists():
        time.sleep(5)
    for p in spinners:
        os.kill(p.pid, signal.SIGCONT)
    # The load needs a moment to be back at full speed before a run shares the machine with it.
    time.sleep(2)


def load_runs(path: Path) -> tuple[int, list[Run]]:
    """The competing load and the runs of one sweep's JSON file."""
    data = json.loads(path.read_text())
    runs = [Run(**{**r, "attempts": [claims.AttemptLine(**a) for a in r["attempts"]]}) for r in data["runs"]]
    return data["load"], runs


def report_files(paths: list[Path]) -> str:
    """One table per competing load, over the runs of every file given (sweeps of one condition add up)."""
    by_load: dict[int, list[Run]] = defaultdict(list)
    for path in paths:
        load, runs = load_runs(path)
        by_load[load] += runs
    return "\n\n".join(report(runs, load) for load, runs in sorted(by_load.items()))


@functools.cache
def _machine() -> dict[str, str | None]:
    """What ran the sweep; the same for every run, so read once, not after each run."""
    env = env_report()
    return {key: env.get(key) for key in ("cpu", "cpu_capability", "threads", "torch")}


def _write(path: Path | None, runs: list[Run], load: int) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = report(runs, load)
    payload = {"load": load, "machine": _machine(), "runs": [asdict(r) for r in runs], "report": text}
    path.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
