"""The labs' Colab install cell: it installs the kvlab the notebook was executed with, not the default branch.

python tools/install_cell.py check          # exit 1 if a lab's install cell is not the pinned one for kvlab.__version__
python tools/install_cell.py set            # rewrite every lab's install cell (keeps REPO and any extra lines)
python tools/install_cell.py set DIR        # the same on the labs under DIR (tests run it on copies)

The pinned ref is the tag `v<kvlab.__version__>`: a commit cannot name itself, and the version is what
`kvlab.env_report()` prints in every lab's provenance line. `make release VERSION=x.y.z` (tools/release.py,
docs/releasing.md) runs `set` and creates that tag; a fork made with `make fork` needs the same tag pushed.
Where pip cannot reach the repository, the cell's error names the other way in: the release's zip of labs,
run with a local Python and any package-index mirror (README, "Without GitHub").
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import kvlab  # noqa: E402

MARKER = 'if "google.colab" in sys.modules:'
REPO_LINE = re.compile(r'^    REPO = "([^"]+)"\n', re.M)
# The lines of the cell that install kvlab itself, from the `if` to the pip call (old and new forms);
# whatever follows (extra `--no-deps` installs of labs 10 and 11) is kept as it is.
INSTALL_BLOCK = re.compile(
    r'if "google\.colab" in sys\.modules:.*?\n(?:.*\n)*?(?:    subprocess\.run\(\[sys\.executable, "-m", "pip", '
    r'"install", "-q", f"git\+\{REPO\}"\], check=True\)|        raise RuntimeError\(.*\n(?:            .*\n)*?'
    r"        \)(?=\n|$))",
)


def ref() -> str:
    return f"v{kvlab.__version__}"


def cell_text(repo: str) -> str:
    """The install lines for kvlab at `ref()`, from `repo`, with one clear error when pip cannot get it."""
    return (
        f"{MARKER}  # Colab: install the kvlab these outputs come from, next to Colab's torch\n"
        "    import subprocess\n"
        "\n"
        f'    REPO = "{repo}"\n'
        f'    REF = "{ref()}"  # the tag of kvlab.__version__ this notebook was executed with\n'
        '    pip = [sys.executable, "-m", "pip", "install", "-q", f"kvlab @ git+{REPO}@{REF}"]\n'
        "    if subprocess.run(pip).returncode:\n"
        "        raise RuntimeError(\n"
        '            f"pip could not install kvlab {REF} from {REPO}. Without GitHub: run the labs locally from the "\n'
        '            "release\'s zip of labs, with any package-index mirror (README: Without GitHub). For a fork, run "\n'
        '            f"`make fork REPO=<your fork URL>`, commit, and push the tag {REF} to it (git push origin {REF}); "\n'
        '            "or set REPO and REF in this cell."\n'
        "        )\n"
    )


def notebooks(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*.ipynb")
        if not {"_build", "results"} & set(p.parts) and not any(s.startswith(".") for s in p.parts)
    )


def install_cell(nb: dict) -> dict | None:
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and MARKER in "".join(cell["source"]):
            return cell
    return None


def rewrite(text: str) -> str:
    repo = REPO_LINE.search(text)
    if repo is None or not INSTALL_BLOCK.search(text):
        raise ValueError("install cell not in a known form (no REPO line or no pip call)")
    return INSTALL_BLOCK.sub(lambda _: cell_text(repo.group(1)).rstrip("\n"), text, count=1)


def set_cells(root: Path) -> list[Path]:
    changed = []
    for path in notebooks(root):
        nb = json.loads(path.read_text())
        cell = install_cell(nb)
        if cell is None:
            continue
        old = "".join(cell["source"])
        new = rewrite(old)
        if new != old:
            cell["source"] = new.splitlines(keepends=True)
            path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
            changed.append(path)
    return changed


def stale(root: Path) -> list[Path]:
    """Labs whose install cell is missing or does not install kvlab at `ref()`."""
    bad = []
    for path in notebooks(root):
        cell = install_cell(json.loads(path.read_text()))
        text = "" if cell is None else "".join(cell["source"])
        repo = REPO_LINE.search(text)
        if cell is None or repo is None or cell_text(repo.group(1)) not in text + "\n":
            bad.append(path)
    return bad


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["set"] and len(args) <= 2:
        for path in set_cells(Path(args[1]) if len(args) == 2 else ROOT / "book"):
            print(f"install cell -> kvlab {ref()}: {path}")
    elif args == ["check"]:
        bad = stale(ROOT / "book")
        print("\n".join(f"{p}: install cell does not pin kvlab {ref()}" for p in bad) or "ok")
        sys.exit(1 if bad else 0)
    else:
        sys.exit(__doc__)
