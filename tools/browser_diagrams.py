"""The book's diagrams as a reader sees them (`make browser`, after `make book`): every diagram of
`kvlab.book.diagrams.DIAGRAMS` is shown on its chapter page, in both editions, loads, and its smallest text renders at
11 CSS px or more in a 1280-px window and at 9 px or more in a 412-px (phone) window.

The rendered size of an SVG's text is its font size in the SVG's user units times the image's shown width over
the viewBox's width; the font sizes are read from the SVG file the page loads, the width from the DOM.

Run explicitly (`pytest tools/browser_diagrams.py`): it needs the book built first.
"""

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from chromium import ROOT, browser

from kvlab.book.diagrams import DIAGRAMS

HTML = Path(os.environ.get("KVLAB_BOOK_HTML", ROOT / "_build" / "html")).resolve()
# (window width, smallest text in CSS px): a laptop, where the column is 688 px, and a phone.
WINDOWS = [(1280, 11.0), (412, 9.0)]
FONT_SIZE = re.compile(r"font(?:-size)?:\s*([0-9.]+)px")
VIEWBOX = re.compile(r'viewBox="([-0-9.]+) ([-0-9.]+) ([0-9.]+) ([0-9.]+)"')

IMAGES = """
async () => Promise.all(Array.from(document.querySelectorAll("article img")).map(async (img) => {
  img.loading = "eager";
  await img.decode().catch(() => null);
  return {src: img.src, natural: img.naturalWidth, shown: img.getBoundingClientRect().width,
          // the caption is the paragraph after the image, "**Diagram N.** ...", as the book captions figures
          caption: document.evaluate("following::p[1]", img, null, XPathResult.FIRST_ORDERED_NODE_TYPE, null)
            .singleNodeValue?.innerText || ""};
}))
"""


def smallest_font(svg: Path) -> tuple[float, float]:
    """(smallest font size, viewBox width) of an SVG, both in its user units."""
    text = svg.read_text()
    sizes = [float(size) for size in FONT_SIZE.findall(text)]
    box = VIEWBOX.search(text)
    assert sizes and box, f"{svg.name}: no text kept as text, or no viewBox"
    return min(sizes), float(box[3])


def pages_of(chapter: str) -> list[tuple[Path, str]]:
    """The pages that show a chapter's diagram, each with how its caption begins: the English page and its
    Chinese twin (_build/html/zh, `make book-zh`)."""
    return [
        (HTML / "book" / chapter / "index.html", "Diagram"),
        (HTML / "zh" / "book" / "zh" / f"{chapter}.html", "示意图"),
    ]


def test_every_diagram_is_shown_with_readable_text():
    problems, seen = [], 0
    with browser() as chromium:
        for width, minimum in WINDOWS:
            context = chromium.new_context(viewport={"width": width, "height": 900}, offline=True)
            page = context.new_page()
            for diagram in DIAGRAMS.values():
                for path, caption in pages_of(diagram.chapter):
                    if not path.is_file():
                        pytest.fail(f"no built page {path}: run `make book` first", pytrace=False)
                    page.goto(path.as_uri(), wait_until="load")
                    shown = [
                        image
                        for image in page.evaluate(IMAGES)
                        if Path(unquote(urlsplit(image["src"]).path)).name == f"{diagram.name}.svg"
                    ]
                    where = f"{path.relative_to(HTML)} at {width} px: {diagram.name}.svg"
                    if len(shown) != 1:
                        problems.append(f"{where}: shown {len(shown)} times, expected once")
                        continue
                    image = shown[0]
                    if not image["natural"]:
                        problems.append(f"{where}: does not load")
                        continue
                    if not image["caption"].startswith(caption):
                        problems.append(f"{where}: no caption")
                    font, box_width = smallest_font(Path(unquote(urlsplit(image["src"]).path)))
                    px = font * image["shown"] / box_width
                    print(f"{where}: smallest text {px:.1f} px")
                    if px < minimum:
                        problems.append(f"{where}: smallest text {px:.1f} px (under {minimum} px)")
                    seen += 1
            context.close()
    print(f"\n{seen} diagram views checked")
    assert not problems, "\n".join(problems)
