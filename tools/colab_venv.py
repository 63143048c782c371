"""The Colab proof: every lab runs in a clean venv holding only what the labs' install cells give a reader.

python tools/colab_venv.py [--venv .venv-colab] [--jobs 2] [--out _build/colab] [LAB ...]

1. A fresh venv (rebuilt when pyproject.toml or requirements.txt change): torch 2.13.0 first (the CPU wheel the
   repository pins, never a CUDA one; Colab brings its own torch), then kvlab's wheel, built from this tree
   with `python -m build --wheel` and installed alone with the dependencies it declares from the package
   index (`pip install kvlab-*.whl`: what a reader without GitHub installs), then the extra `--no-deps`
   installs the labs' own install cells run (labs 10 and 11), then a kernel (ipykernel) and nbclient.
   Versions are held to requirements.txt with `-c`, so the venv has the same versions as the development
   venv, but only the packages the wheel pulls in. An up-to-date venv gets a freshly built wheel of kvlab on
   every run (`--no-deps --force-reinstall`), so the labs always run the tree's kvlab.
2. Every lab (or the LABs given) is executed there with nbclient, GPU hidden, in its own folder, `--jobs` at a
   time; each executed copy goes to OUT/<chapter>/lab.ipynb (the labs in book/ are not touched). Any error
   in any cell fails the run, naming the lab and the cell's error.

With --nbval, step 2 is nbval instead (pytest and nbval added to the venv): the same execution, and the
stored outputs compared as `make nbval` compares them. `make test` runs that form, so its check of the labs
executes them once, in the clean venv, and nbval in the development venv is not run a second time.
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

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
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


def extra_installs(notebooks: list[Path]) -> list[list[str]]:
    """The `pip install --no-deps ...` argument lists of the labs' install cells (what Colab runs after kvlab)."""
    found: list[list[str]] = []
    for path in notebooks:
        for cell in json.loads(path.read_text())["cells"]:
            text = "".join(cell["source"])
            if cell["cell_type"] != "code" or 'if "google.colab" in sys.modules' not in text:
                continue
            for call in re.findall(r"subprocess\.run\(\[(.*?)\]", text, re.S):
                args = [a for a in re.findall(r'"([^"]*)"', call)]
                if "--no-deps" in args:
                    packages = [a for a in args[args.index("--no-deps") + 1 :]]
                    if packages not in found:
                        found.append(packages)
    return found


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


def build(venv: Path) -> float:
    """Create the clean venv unless it is up to date, and install this tree's kvlab wheel; the seconds it took."""
    key = hashlib.sha256(
        b"".join((ROOT / f).read_bytes() for f in ("pyproject.toml", "requirements.txt"))
        + json.dumps(extra_installs(labs())).encode()
        + RUNNER.encode()
        + " ".join(KERNEL_PACKAGES + NBVAL_PACKAGES).encode()
    ).hexdigest()
    stamp = venv / STAMP
    start = time.perf_counter()
    constraints = ["-c", str(ROOT / "requirements.txt")]
    with tempfile.TemporaryDirectory(prefix="kvlab-wheel-") as dist:
        wheel = build_wheel(Path(dist))
        if stamp.is_file() and stamp.read_text() == key:
            pip(venv, "--no-deps", "--force-reinstall", str(wheel))
            return 0.0
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip(venv, TORCH)
        pip(venv, str(wheel), *constraints)
    for packages in extra_installs(labs()):
        pip(venv, "--no-deps", *packages)
    pip(venv, *KERNEL_PACKAGES, *NBVAL_PACKAGES, *constraints)
    # The venv must not see the development tree: kvlab comes from site-packages.
    check = "import kvlab, pathlib; p = pathlib.Path(kvlab.__file__); assert 'site-packages' in p.parts, p"
    subprocess.run([str(venv / "bin" / "python"), "-c", check], check=True, cwd="/")
    stamp.write_text(key)
    return time.perf_counter() - start


def lab_env(venv: Path, capped: bool = False) -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1")
    if capped:
        env.update(CAPPED_ISA)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["JUPYTER_PREFER_ENV_PATH"] = "1"  # the venv's own python3 kernel, not one registered elsewhere
    return env


def nbval(venv: Path, notebooks: list[Path], capped: bool = False) -> int:
    """nbval in the clean venv: every lab executed there, stored outputs compared (GPU hidden); `capped`
    runs torch, MKL and oneDNN on their baseline kernels (CAPPED_ISA)."""
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "--nbval", *map(str, notebooks)]
    cmd += ["--sanitize-with", str(ROOT / "tests" / "nbval_sanitize.cfg"), "-p", "no:cacheprovider", "-q"]
    cmd += ["--rootdir", str(ROOT), "-c", os.devnull]  # the repo's pytest config imports nothing from src
    env = lab_env(venv, capped)
    check = "import torch; print('torch CPU capability:', torch.backends.cpu.get_cpu_capability())"
    subprocess.run([str(venv / "bin" / "python"), "-c", check], env=env, cwd=ROOT, check=True)
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def execute(venv: Path, lab: Path, out: Path) -> tuple[Path, bool, str, float]:
    dst = out / lab.parent.name / "lab.ipynb"
    dst.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", RUNNER, str(lab), str(dst), str(lab.parent)],
        capture_output=True,
        text=True,
        env=lab_env(venv),
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
        print(f"{lab.relative_to(ROOT)}: {message} ({seconds:.0f} s wall)")
    failed = [lab for lab, ok, _, _ in results if not ok]
    print(
        f"{len(results) - len(failed)}/{len(results)} labs ran in the clean venv "
        f"({time.perf_counter() - start:.0f} s, {args.jobs} at a time)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
