"""Run a stage of `make test` with a home folder and caches of its own, empty when the stage starts.

python3 tools/fresh_home.py STAGE -- COMMAND [ARG ...]

The folder is _build/home/STAGE, removed and made anew, and every cache the labs and tests write lives under
it: kvlab's dequantized real model, Hugging Face's hub, matplotlib's font list, TorchInductor, IPython and
Jupyter. A stage sees only what it installed or wrote itself: a copy of the real model that another venv
saved in ~/.cache/kvlab once hid a missing `accelerate` from every CI run.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOMES = ROOT / "_build" / "home"


def home_env(home: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with HOME and every cache the labs write moved under `home`."""
    env = dict(os.environ if base is None else base)
    cache = home / ".cache"
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(cache),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        KVLAB_CACHE=str(cache / "kvlab"),
        HF_HOME=str(cache / "huggingface"),
        MPLCONFIGDIR=str(home / ".config" / "matplotlib"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "torchinductor"),
        TRITON_CACHE_DIR=str(cache / "triton"),
        IPYTHONDIR=str(home / ".ipython"),
        JUPYTER_CONFIG_DIR=str(home / ".jupyter"),
        JUPYTER_DATA_DIR=str(home / ".local" / "share" / "jupyter"),
        JUPYTER_RUNTIME_DIR=str(home / ".local" / "share" / "jupyter" / "runtime"),
    )
    # A variable that points a cache elsewhere would bypass the empty home.
    for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME"):
        env.pop(name, None)
    return env


def fresh_home(stage: str) -> Path:
    """_build/home/STAGE, emptied."""
    if not stage or "/" in stage or stage.startswith("."):
        raise ValueError(f"a stage is one plain folder name, not {stage!r}")
    home = HOMES / stage
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    return home


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python3 tools/fresh_home.py STAGE -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    env = home_env(fresh_home(argv[0]))
    os.execvpe(argv[2], argv[2:], env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
