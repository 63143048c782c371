"""The repository URL lives in _config.yml; the labs' Colab install line must agree with it.

python tools/repo_url.py check        # exit 1 if a notebook disagrees
python tools/repo_url.py set URL      # point _config.yml and every lab at a fork (make fork REPO=URL)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "_config.yml"
REPO_LINE = re.compile(r'(REPO = ")([^"]+)(")')
CONFIG_LINE = re.compile(r"(^repository:\n  url: )(\S+)", re.M)


def configured_url() -> str:
    match = CONFIG_LINE.search(CONFIG.read_text())
    if not match:
        raise SystemExit("_config.yml has no repository.url")
    return match.group(2)


def notebooks() -> list[Path]:
    # Skip build output and hidden folders (JupyterLab's .ipynb_checkpoints).
    return sorted(
        p
        for p in (ROOT / "book").rglob("*.ipynb")
        if "_build" not in p.parts and not any(part.startswith(".") for part in p.parts)
    )


def notebook_urls(path: Path) -> set[str]:
    cells = json.loads(path.read_text())["cells"]
    text = "".join("".join(c["source"]) for c in cells)
    urls = set(REPO_LINE.findall(text))
    urls |= set(re.findall(r"\((https://github\.com/[^)/]+/[^)/]+)/blob/", text))
    return {u if isinstance(u, str) else u[1] for u in urls}


def set_url(url: str) -> None:
    old = configured_url()
    CONFIG.write_text(CONFIG_LINE.sub(lambda m: m.group(1) + url, CONFIG.read_text()))
    for path in notebooks():
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            cell["source"] = [line.replace(old, url) for line in cell["source"]]
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    for md in (ROOT / "book").rglob("*.md"):
        md.write_text(md.read_text().replace(old, url))
    print(f"repository URL: {old} -> {url}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["set"] and len(sys.argv) == 3:
        set_url(sys.argv[2])
    elif sys.argv[1:] == ["check"]:
        bad = [p for p in notebooks() if notebook_urls(p) - {configured_url()}]
        print("\n".join(map(str, bad)) or "ok")
        sys.exit(1 if bad else 0)
    else:
        sys.exit(__doc__)
