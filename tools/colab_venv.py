"""The Colab proof: every lab runs in a venv shaped like Colab's GPU runtime, with only its own install cell's packages.

python tools/colab_venv.py [--venv .venv-colab] [--jobs 2] [--out _build/colab] [--nbval] [LAB ...]

1. The runtime (rebuilt when pyproject.toml, requirements.txt, the labs' installs or Colab's list change):
   torch 2.13.0 (the CPU wheel; Colab brings its own CUDA build), then, at the versions of Colab's published
   GPU runtime (tools/colab/pip-freeze.gpu.txt), every package of that list that `pip install kvlab` can
   touch, with the Colab packages the labs use beyond kvlab's own dependencies (COLAB_PRELOADED). Then
   kvlab's wheel, built from this tree and installed as a Colab reader's install cell does, so pip moves
   only what kvlab requires; what it moved is written to VENV/kvlab-changes.json and printed. Packages
   outside Colab's list are held to requirements.txt with `-c`. An up-to-date venv gets a freshly built
   wheel of kvlab on every run (`--no-deps --force-reinstall`), so the labs always run the tree's kvlab.
2. Each lab's own `pip install --no-deps ...` lines (what its install cell adds on Colab) go to a folder of
   their own, VENV/extras/<hash>, put on that lab's PYTHONPATH alone: a lab that imports a package its cell
   does not install, and Colab does not ship, fails here as it would on Colab.
3. Every lab (or the LABs given) runs with nbclient, GPU hidden, `--jobs` at a time, with a home folder and
   caches of its own, empty at the start (tools/fresh_home.py); each executed copy goes to
   OUT/<chapter>/lab.ipynb. Any error in any cell fails the run, naming the lab and the cell's error.

With --nbval, step 3 is nbval instead (pytest and nbval added to the venv), once per group of labs with the
same installs: the same execution, and the stored outputs compared as `make nbval` compares them.

Colab runs Python 3.13 (tools/colab/README.md); this venv has the machine's python3 (3.11 in CI).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fresh_home import fresh_home, home_env

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
COLAB_FREEZE = ROOT / "tools" / "colab" / "pip-freeze.gpu.txt"
# Packages of Colab's runtime that the labs use beyond kvlab's own dependencies: transformers loads the real
# model's GGUF file with accelerate (chapters 8-11, 16). Installed at Colab's version; a test checks the list.
COLAB_PRELOADED = ["accelerate"]
KERNEL_PACKAGES = ["ipykernel", "nbclient"]
NBVAL_PACKAGES = ["pytest", "nbval"]
STAMP = ".kvlab-colab"
# The lowest kernels torch, MKL and oneDNN fall back to on any x86-64 CPU. Stored outputs written on one CPU
# must compare equal when the labs run on these: a cell whose output changes is machine-dependent.
CAPPED_ISA = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}

# Executed inside the clean venv: run one notebook with nbclient, write it, print a one-line verdict.
RUNNER = r"""
import sys, time
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
src, dst = sys.argv[1], sys.argv[2]
nb = nbformat.read(src, as_version=4)
start = time.perf_counter()
client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": sys.argv[3]}})
try:
    client.execute()
except CellExecutionError as err:
    nbformat.write(nb, dst)
    lines = [l for l in str(err).splitlines() if l.strip()]
    print("FAILED: " + (lines[-1] if lines else "cell error"))
    sys.exit(1)
nbformat.write(nb, dst)
print(f"ok in {time.perf_counter() - start:.1f} s")
"""


def labs() -> list[Path]:
    return sorted(
        p
        for p in (ROOT / "book").rglob("lab.ipynb")
        if "_build" not in p.parts and not any(s.startswith(".") for s in p.parts)
    )


def is_timed(lab: Path) -> bool:
    """A timed lab measures a claim on the clock (`kvlab.claims.measure_claim`), so it must run on a machine that
    nothing else of the test run loads; the other labs' checks are the same under any load."""
    return any(
        "measure_claim" in "".join(cell["source"])
        for cell in json.loads(lab.read_text())["cells"]
        if cell["cell_type"] == "code"
    )


def _install_calls(path: Path) -> list[list[str]]:
    """The `pip install --no-deps ...` package lists of one lab's install cell (what Colab runs after kvlab)."""
    found: list[list[str]] = []
    for cell in json.loads(path.read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] != "code" or 'if "google.colab" in sys.modules' not in text:
            continue
        for call in re.findall(r"subprocess\.run\(\s*\[(.*?)\]", text, re.S):
            args = re.findall(r'"([^"]*)"', call)
            if "--no-deps" in args:
                found.append(args[args.index("--no-deps") + 1 :])
    return found


def extra_installs(notebooks: list[Path]) -> list[list[str]]:
    """The distinct `pip install --no-deps ...` argument lists of the labs' install cells."""
    found: list[list[str]] = []
    for path in notebooks:
        for packages in _install_calls(path):
            if packages not in found:
                found.append(packages)
    return found


def lab_installs(lab: Path) -> tuple[str, ...]:
    """Every package one lab's install cell adds, sorted: the labs with the same tuple share an extras folder."""
    return tuple(sorted({p for packages in _install_calls(lab) for p in packages}))


def extras_dir(venv: Path, packages: tuple[str, ...]) -> Path:
    return venv / "extras" / hashlib.sha256(" ".join(packages).encode()).hexdigest()[:12]


def _name(requirement: str) -> str:
    """A distribution's normalized name (PEP 503) from `name==version` or a bare name."""
    return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~\[ ;@]", requirement, maxsplit=1)[0]).lower()


def colab_pins() -> dict[str, str]:
    """Colab's GPU runtime, name -> version, less what a CPU machine cannot install: CUDA builds (`+cu`) and
    packages pinned by URL or path (`name @ ...`), RAPIDS among them."""
    pins: dict[str, str] = {}
    for line in COLAB_FREEZE.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
        if match and "+cu" not in match.group(2):
            pins[_name(match.group(1))] = match.group(2)
    return pins


def pip(venv: Path, *args: str) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args]
    print("+ " + shlex.join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def build_wheel(out: Path) -> Path:
    """kvlab's wheel from this tree (`python -m build --wheel`, with the development venv's `build` when this
    Python has none: `make` runs this script with the system python3)."""
    python = sys.executable if importlib.util.find_spec("build") else str(ROOT / ".venv" / "bin" / "python")
    cmd = [python, "-m", "build", "--wheel", "--quiet", "--outdir", str(out)]
    print("+ " + shlex.join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    (wheel,) = out.glob("kvlab-*.whl")
    return wheel


def _freeze(venv: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {_name(p["name"]): p["version"] for p in json.loads(out)}


def _touched(venv: Path, wheel: Path, constraints: Path) -> list[str]:
    """Every distribution `pip install kvlab` (with COLAB_PRELOADED and a kernel) can install: pip's own
    resolution, from a dry run that installs nothing."""
    with tempfile.TemporaryDirectory(prefix="kvlab-report-") as tmp:
        report = Path(tmp) / "report.json"
        pip(
            venv,
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            str(wheel),
            *COLAB_PRELOADED,
            "ipykernel",
            "-c",
            str(constraints),
        )
        return sorted(_name(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"])


def _fill_from_colab(venv: Path, colab: dict[str, str]) -> None:
    """Install, at Colab's versions, what the packages already in the venv require and Colab ships (IPython
    7.34's own dependencies, say), until `pip check` names none of them missing."""
    while True:
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "check"], capture_output=True, text=True
        ).stdout
        missing = {_name(m) for m in re.findall(r"requires ([A-Za-z0-9._-]+), which is not installed", out)}
        found = sorted(name for name in missing if name in colab)
        if not found:
            return
        pip(venv, "--no-deps", *(f"{name}=={colab[name]}" for name in found))


def changes_table(before: dict[str, str], after: dict[str, str]) -> list[dict[str, str]]:
    """What `pip install kvlab` did to Colab's runtime: one row per package added or moved."""
    return [
        {"package": name, "colab": before.get(name, "-"), "after": after[name]}
        for name in sorted(after)
        if before.get(name) != after[name] and name != "kvlab"
    ]


def build(venv: Path) -> float:
    """Create the Colab-shaped venv unless it is up to date, and install this tree's kvlab wheel; the seconds it
    took."""
    chosen = labs()
    key = hashlib.sha256(
        b"".join((ROOT / f).read_bytes() for f in ("pyproject.toml", "requirements.txt"))
        + COLAB_FREEZE.read_bytes()
        + Path(__file__).read_bytes()
        + json.dumps([extra_installs(chosen), COLAB_PRELOADED]).encode()
        + RUNNER.encode()
        + " ".join(KERNEL_PACKAGES + NBVAL_PACKAGES).encode()
    ).hexdigest()
    stamp = venv / STAMP
    start = time.perf_counter()
    colab = colab_pins()
    with tempfile.TemporaryDirectory(prefix="kvlab-wheel-") as dist:
        wheel = build_wheel(Path(dist))
        if stamp.is_file() and stamp.read_text() == key:
            pip(venv, "--no-deps", "--force-reinstall", str(wheel))
            return 0.0
        # Packages Colab does not ship are held to this repository's pins; Colab's own keep Colab's versions
        # unless kvlab requires another.
        constraints = Path(dist) / "constraints.txt"
        constraints.write_text(
            "".join(
                line + "\n"
                for line in (ROOT / "requirements.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#") and _name(line) not in colab
            )
        )
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        runtime = [f"{name}=={colab[name]}" for name in _touched(venv, wheel, constraints) if name in colab]
        pip(venv, "--no-deps", *runtime)
        _fill_from_colab(venv, colab)
        # After Colab's list: what the CPU torch moves (setuptools>=77) is this venv's, not kvlab's change.
        pip(venv, TORCH)
        before = _freeze(venv)
        pip(venv, str(wheel), *COLAB_PRELOADED, "-c", str(constraints))
        table = changes_table(before, _freeze(venv))
        (venv / "kvlab-changes.json").write_text(json.dumps(table, indent=1) + "\n")
        print("what `pip install kvlab` changed in Colab's runtime:", flush=True)
        for row in table:
            print(f"  {row['package']}: {row['colab']} -> {row['after']}", flush=True)
        pip(venv, *KERNEL_PACKAGES, *NBVAL_PACKAGES, "-c", str(constraints))
    for packages in {lab_installs(lab) for lab in chosen} - {()}:
        target = extras_dir(venv, packages)
        pip(venv, "--no-deps", "--target", str(target), *packages)
    # The venv must not see the development tree: kvlab comes from site-packages.
    check = "import kvlab, pathlib; p = pathlib.Path(kvlab.__file__); assert 'site-packages' in p.parts, p"
    subprocess.run([str(venv / "bin" / "python"), "-c", check], check=True, cwd="/")
    stamp.write_text(key)
    return time.perf_counter() - start


def lab_env(venv: Path, home: Path, installs: tuple[str, ...] = (), capped: bool = False) -> dict[str, str]:
    """The environment a lab runs in: the venv, an empty home of its own, and only its own cell's extras."""
    env = home_env(home, dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1"))
    if capped:
        env.update(CAPPED_ISA)
    env.pop("PYTHONPATH", None)
    if installs:
        env["PYTHONPATH"] = str(extras_dir(venv, installs))
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["JUPYTER_PREFER_ENV_PATH"] = "1"  # the venv's own python3 kernel, not one registered elsewhere
    return env


def groups(notebooks: list[Path]) -> dict[tuple[str, ...], list[Path]]:
    """The labs by what their install cells add."""
    found: dict[tuple[str, ...], list[Path]] = {}
    for lab in notebooks:
        found.setdefault(lab_installs(lab), []).append(lab)
    return found


def nbval(venv: Path, notebooks: list[Path], capped: bool = False) -> int:
    """nbval in the Colab-shaped venv, once per group of labs with the same installs: every lab executed
    there, stored outputs compared (GPU hidden); `capped` runs torch, MKL and oneDNN on their baseline kernels
    (CAPPED_ISA). Each group starts from an empty home."""
    code = 0
    for n, (installs, members) in enumerate(groups(notebooks).items()):
        stage = f"colab-nbval{'-capped' if capped else ''}-{n}"
        env = lab_env(venv, fresh_home(stage), installs, capped)
        print(
            f"labs with installs {list(installs) or 'none'}: {', '.join(m.parent.name for m in members)}",
            flush=True,
        )
        cmd = [str(venv / "bin" / "python"), "-m", "pytest", "--nbval", *map(str, members)]
        cmd += ["--sanitize-with", str(ROOT / "tests" / "nbval_sanitize.cfg"), "-p", "no:cacheprovider", "-q"]
        # The repo's pytest config imports nothing from src.
        cmd += ["--rootdir", str(ROOT), "-c", os.devnull]
        check = "import torch; print('torch CPU capability:', torch.backends.cpu.get_cpu_capability())"
        subprocess.run([str(venv / "bin" / "python"), "-c", check], env=env, cwd=ROOT, check=True)
        code = max(code, subprocess.run(cmd, env=env, cwd=ROOT).returncode)
    return code


def execute(venv: Path, lab: Path, out: Path) -> tuple[Path, bool, str, float]:
    dst = out / lab.parent.name / "lab.ipynb"
    dst.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", RUNNER, str(lab), str(dst), str(lab.parent)],
        capture_output=True,
        text=True,
        env=lab_env(venv, fresh_home(f"colab-{lab.parent.name}"), lab_installs(lab)),
        cwd=lab.parent,
    )
    seconds = time.perf_counter() - start
    lines = (done.stdout + done.stderr).strip().splitlines()
    message = next((line for line in reversed(lines) if line.startswith(("ok", "FAILED"))), "")
    if not message:
        message = "FAILED: " + (lines[-1] if lines else f"exit {done.returncode}")
    return lab, done.returncode == 0, message, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", type=Path)
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-colab")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "colab")
    parser.add_argument(
        "--nbval", action="store_true", help="run nbval in the clean venv instead of nbclient"
    )
    parser.add_argument(
        "--capped-isa",
        action="store_true",
        help="with --nbval: run on the baseline kernels of torch, MKL and oneDNN ("
        + " ".join(f"{k}={v}" for k, v in CAPPED_ISA.items())
        + ")",
    )
    parser.add_argument(
        "--kind",
        choices=["all", "timed", "untimed"],
        default="all",
        help="of the labs chosen: all, the timed ones (they call kvlab.claims.measure_claim), or the others",
    )
    args = parser.parse_args(argv)
    chosen = [p.resolve() for p in args.labs] or labs()
    if args.kind != "all":
        chosen = [lab for lab in chosen if is_timed(lab) == (args.kind == "timed")]
    missing = [str(p) for p in chosen if not p.is_file()]
    if missing:
        sys.exit(f"no such lab: {', '.join(missing)}")
    built = build(args.venv.resolve())
    state = f"built in {built:.0f} s" if built else "up to date (this tree's kvlab wheel reinstalled)"
    print(f"clean venv {args.venv}: {state}", flush=True)
    start = time.perf_counter()
    if args.nbval:
        code = nbval(args.venv.resolve(), chosen, args.capped_isa)
        kernels = "baseline kernels (capped ISA)" if args.capped_isa else "this CPU's own kernels"
        print(
            f"nbval in the clean venv on {kernels}: {len(chosen)} labs, "
            f"{time.perf_counter() - start:.0f} s, exit {code}"
        )
        return code
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda lab: execute(args.venv.resolve(), lab, args.out.resolve()), chosen))
    for lab, _ok, message, seconds in results:
        print(
            f"{lab.relative_to(ROOT) if lab.is_relative_to(ROOT) else lab}: {message} ({seconds:.0f} s wall)"
        )
    failed = [lab for lab, ok, _, _ in results if not ok]
    print(
        f"{len(results) - len(failed)}/{len(results)} labs ran in the clean venv "
        f"({time.perf_counter() - start:.0f} s, {args.jobs} at a time)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
