"""`make pdf` (tools/pdf.py): the whole book printed offline, read back with poppler's pdftotext and pdfimages.

Every chapter's title and every figure caption of the chapter pages is in the PDF's text, the figures are
embedded as images, and the page count is in a sane range. Building it takes a few minutes of one core; it
times nothing, so it is not marked slow. Outside CI it skips when Chromium or poppler-utils is missing; in
CI (.ci/run installs both) it fails instead.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import chromium
import pdf
import pytest

ROOT = Path(__file__).resolve().parents[1]
POPPLER = ("pdftotext", "pdfinfo", "pdfimages")
CAPTION = re.compile(r"^\*\*(Figure \d+\.\d+\.)\*\*(.*(?:\n(?!\n).*)*)", re.M)
# Where a caption's plain words stop: roles, math, code and links render as something else.
MARKUP = re.compile(r"[`{$\[*\\]")
PAGES = range(100, 1001)


def chapter_pages() -> list[Path]:
    toc = pdf.english_toc()
    return [ROOT / f"{c['file']}.md" for part in toc["parts"] for c in part["chapters"]]


def plain(text: str) -> str:
    """Whitespace collapsed and quotes straightened, as Sphinx's smart quotes and pdftotext's lines differ."""
    text = text.translate(str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"'}))
    return " ".join(text.split())


def chapter_titles() -> list[str]:
    return [
        plain(p.read_text().split("\n# ", 1)[0].removeprefix("# ").splitlines()[0]) for p in chapter_pages()
    ]


def figure_captions() -> list[str]:
    """Each caption's label and its first plain words (up to eight, before any markup)."""
    captions = []
    for page in chapter_pages():
        for label, body in CAPTION.findall(page.read_text()):
            words = MARKUP.split(body, maxsplit=1)[0].split()[:8]
            captions.append(plain(" ".join([label, *words])))
    return captions


@pytest.fixture(scope="module")
def book_pdf(tmp_path_factory):
    missing = [tool for tool in POPPLER if shutil.which(tool) is None]
    missing += [] if chromium.executable() else ["chromium"]
    if missing:
        hint = f"needs {', '.join(missing)}: apt-get install chromium poppler-utils (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(hint, pytrace=False)
        pytest.skip(hint)
    work = tmp_path_factory.mktemp("pdf")
    out = work / "kvlab.pdf"
    assert pdf.main(["--out", str(out), "--work", str(work)]) == 0
    return out


def test_the_pdf_leaves_out_the_chinese_pages():
    printed = [c["file"] for part in pdf.english_toc()["parts"] for c in part["chapters"]]
    assert not [f for f in printed if f.startswith("book/zh/")] and "book/01_cache_contents/index" in printed


def test_the_sources_give_titles_and_captions():
    titles, captions = chapter_titles(), figure_captions()
    # Every numbered chapter of the English table of contents, and the appendix
    printed = [c["file"] for part in pdf.english_toc()["parts"] for c in part["chapters"]]
    assert len(titles) == len(printed) >= 17 and titles[0] == "1. What the KV cache holds"
    assert "16. Keeping fewer tokens" in titles
    assert len(captions) >= 30 and all(len(c.split()) >= 4 for c in captions), captions


def test_the_pdf_holds_every_chapter_title_and_figure(book_pdf):
    text = plain(subprocess.run(["pdftotext", str(book_pdf), "-"], capture_output=True, text=True).stdout)
    missing = [t for t in chapter_titles() + figure_captions() if t not in text]
    assert not missing, f"not in {book_pdf}'s text: {missing}"
    listed = subprocess.run(["pdfimages", "-list", str(book_pdf)], capture_output=True, text=True).stdout
    images = len(listed.splitlines()) - 2
    assert images >= len(figure_captions()), f"{images} images for {len(figure_captions())} figures"
    info = subprocess.run(["pdfinfo", str(book_pdf)], capture_output=True, text=True).stdout
    pages = int(re.search(r"^Pages:\s+(\d+)", info, re.M).group(1))
    assert pages in PAGES, f"{pages} pages"


def test_the_pdf_shows_the_calculator_as_its_address_not_a_dead_form(book_pdf):
    """The calculator page prints a note (_ext/kvlab_calculator.py): the page's address and the command."""
    text = plain(subprocess.run(["pdftotext", str(book_pdf), "-"], capture_output=True, text=True).stdout)
    assert "The calculator runs in the web edition of this book" in text
    assert "kvlab.github.io/kvlab/book/calculator/index.html" in text.replace(" ", "")
    # the form's labels, which would print as fields no one can fill in
    assert "Concurrent sequences" not in text and "Loading Python in your browser" not in text
