"""Reading the book's pages and labs, for the tests that check what a page says against what kvlab computes."""

import json
import re
from pathlib import Path

BOOK = Path(__file__).resolve().parents[1] / "book"
ANSWER = re.compile(r"```\{dropdown\} Answer\n(.*?)\n```", re.DOTALL)
TAKEAWAYS = re.compile(r":::\{admonition\} Takeaways\n(.*?)\n:::", re.DOTALL)


def page(name: str) -> str:
    """A page's MyST source: `name` is a file under book/ ("intro.md") or a chapter folder (its index.md)."""
    path = BOOK / name if name.endswith(".md") else BOOK / name / "index.md"
    return path.read_text()


def flat(text: str) -> str:
    return " ".join(text.split())


def answers(name: str) -> list[str]:
    """The folded answers of a page, in page order, with line breaks folded to spaces."""
    found = [flat(block) for block in ANSWER.findall(page(name))]
    assert found, f"{name} has no ```{{dropdown}} Answer block"
    return found


def lab_parameters(chapter: str) -> dict[str, object]:
    """The values of a lab's parameters cell, as the reader would change them."""
    notebook = json.loads((BOOK / chapter / "lab.ipynb").read_text())
    cell = next(c for c in notebook["cells"] if "parameters" in c["metadata"].get("tags", []))
    values: dict[str, object] = {}
    exec("".join(cell["source"]), {}, values)
    return values
