"""The built book, read in headless Chromium from disk with no network (`make browser`, after `make book`).

Per page of _build/html: every image loads; every local link and anchor resolves; no raw `\\(`, `\\[`, `$$` or
`{glue` is left in the text; MathJax typeset every equation; no JavaScript error; a full-page screenshot is saved
under _build/screenshots/book/. Readability is reported, not asserted (labs own their figures), in
_build/screenshots/readability.txt: figures whose tick text renders under 9 pt (estimated from kvlab.plot's
sizes and the image's scale), numeric font sizes fixed in labs, "chapter N" references that are not links, and
display equations wider than the column.

Run explicitly (`pytest tools/browser_book.py`): it needs the book built first.
"""

import json
import os
import re
import struct
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from chromium import ROOT, SCREENSHOTS, browser

from kvlab import plot

HTML = Path(os.environ.get("KVLAB_BOOK_HTML", ROOT / "_build" / "html")).resolve()  # the built book
VIEWPORT = {"width": 1280, "height": 900}  # a laptop screen; the book's column is what it is at this width
MIN_PT = 9.0  # smallest readable legend / tick text in the rendered figure
SKIP = {"genindex.html"}  # generated, no content of ours
RAW = [r"\(", r"\[", "$$", "{glue"]
ZH_EDITION = "zh"  # the Chinese edition's folder in the built site

PAGE_CHECKS = r"""
async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  const images = Array.from(document.images);
  await Promise.all(images.map((img) => { img.loading = "eager"; return img.decode().catch(() => null); }));
  const broken = images.filter((img) => !img.complete || img.naturalWidth === 0).map((img) => img.src);
  const figures = images.filter((img) => img.naturalWidth > 0 && img.closest("article"))
    .map((img) => ({src: img.src, natural: img.naturalWidth, shown: img.getBoundingClientRect().width}));
  const links = Array.from(document.querySelectorAll("a[href]"))
    .filter((a) => !a.closest(".kvlab-jupyterlab-only")).map((a) => a.href);
  const maths = Array.from(document.querySelectorAll(".math"));
  const untypeset = maths.filter((m) => !m.querySelector("mjx-container")).map((m) => m.textContent.slice(0, 80));
  const mathErrors = Array.from(document.querySelectorAll("mjx-merror, [data-mjx-error]"))
    .map((e) => e.getAttribute("data-mjx-error") || e.textContent)
    .concat(Array.from(document.querySelectorAll("mjx-assistive-mml"))  // TeX typeset literally, e.g. \_
      .map((e) => e.textContent).filter((t) => t.includes("\\")));
  const body = document.body.cloneNode(true);
  body.querySelectorAll("pre, code, script, style, mjx-container, .kvlab-jupyterlab-only").forEach((e) => e.remove());
  const text = document.querySelector("main") ? body.querySelector("main").innerText : body.innerText;
  const walker = document.createTreeWalker(document.querySelector("article") || document.body, NodeFilter.SHOW_TEXT);
  const crossRefs = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest("a, pre, code, h1, .kvlab-jupyterlab-only")) continue;
    for (const m of node.textContent.matchAll(/\b(chapters? \d+(?:[-–]\d+)?|(?:next|previous) chapter)\b/gi)) {
      crossRefs.push(m[0]);
    }
  }
  const wideMath = Array.from(document.querySelectorAll('mjx-container[display="true"]'))  // cut at the column
    .filter((c) => c.querySelector("mjx-math").getBoundingClientRect().width > c.getBoundingClientRect().width + 1)
    .map((c) => c.querySelector("mjx-assistive-mml")?.textContent);
  return {broken, figures, links, maths: maths.length, untypeset, mathErrors, text, crossRefs, wideMath};
}
"""


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)


_ids_cache: dict[Path, set[str]] = {}


def ids_of(path: Path) -> set[str]:
    if path not in _ids_cache:
        parser = _Ids()
        parser.feed(path.read_text(encoding="utf-8", errors="replace"))
        _ids_cache[path] = parser.ids
    return _ids_cache[path]


def local_link_problem(href: str, page: Path) -> str | None:
    """None when a file:// link resolves (the file exists, and so does its #anchor); else what is wrong."""
    parts = urlsplit(href)
    if parts.scheme != "file":
        return None  # http(s), mailto, javascript: not local
    target = Path(unquote(parts.path))
    if target.is_dir():
        target = target / "index.html"
    if not target.is_file():
        return f"{href}: no such file"
    anchor = unquote(parts.fragment)
    if anchor and target.suffix == ".html" and anchor not in ids_of(target):
        return f"{href}: no #{anchor} in {target.relative_to(HTML)}"
    return None


def png_dpi(path: Path) -> float | None:
    """Pixels per inch from a PNG's pHYs chunk (matplotlib writes it), else None."""
    data = path.read_bytes()
    at = data.find(b"pHYs")
    if at < 0:
        return None
    x, _y, unit = struct.unpack(">IIB", data[at + 4 : at + 13])
    return x * 0.0254 if unit == 1 else None


def figure_text_pt(figure: dict) -> float | None:
    """Rendered size, in CSS points, of kvlab.plot's tick and legend text in this figure image."""
    parts = urlsplit(figure["src"])
    if parts.scheme != "file" or not figure["natural"]:
        return None
    dpi = png_dpi(Path(unquote(parts.path)))
    if not dpi:
        return None
    width_inches = figure["natural"] / dpi
    # Tick labels, as kvlab.plot sizes them (a lab's fixed font size is listed by fixed_font_notes).
    font_pt = plot.STYLE["xtick.labelsize"] * plot.text_scale(width_inches)
    font_px = font_pt * dpi / 72  # text height in image pixels
    return font_px * figure["shown"] / figure["natural"] * 0.75  # CSS px -> pt


def fixed_font_notes() -> list[str]:
    """Labs that set a numeric font size bypass kvlab.plot's width scaling; list each such call."""
    notes = []
    for lab in sorted((ROOT / "book").glob("*/lab.ipynb")):
        cells = json.loads(lab.read_text())["cells"]
        for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
            for match in re.finditer(
                r"\b(fontsize|labelsize|size)=(\d+(?:\.\d+)?)\b", "".join(cell["source"])
            ):
                notes.append(
                    f"{lab.relative_to(ROOT)} code cell {i}: {match[0]} (fixed size, not scaled by kvlab.plot)"
                )
    return notes


def pages() -> list[Path]:
    if not (HTML / "index.html").is_file():
        pytest.fail("no built book in _build/html: run `make book` first", pytrace=False)
    # The Chinese edition (zh/, built by `make book-zh`) has its own test: tools/browser_zh.py.
    return sorted(
        p
        for p in HTML.rglob("*.html")
        if "_static" not in p.parts and p.name not in SKIP and p.relative_to(HTML).parts[0] != ZH_EDITION
    )


def read_page(context, path: Path, screenshot: Path | None) -> tuple[list[str], list[str], bool]:
    """Open one built page in a browser context: (its problems, its readability notes, whether a screenshot was
    saved). A redirect page (the root index.html) only has its target checked."""
    name = str(path.relative_to(HTML))
    redirect = re.search(r'http-equiv="refresh" content="0; url=([^"]+)"', path.read_text(), re.IGNORECASE)
    if redirect:  # the root index.html only forwards to the first page
        target = local_link_problem((path.parent / redirect[1]).as_uri(), path)
        return ([f"{name}: {target}"] if target else []), [], False
    problems, notes = [], []
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda m, c=console: c.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e, c=console: c.append(str(e)))
    page.on("requestfailed", lambda r, c=console: c.append(f"failed to load {r.url}"))
    page.goto(path.as_uri(), wait_until="load")
    found = page.evaluate(PAGE_CHECKS)
    problems += [f"{name}: image does not load: {src}" for src in found["broken"]]
    problems += [f"{name}: {p}" for href in set(found["links"]) if (p := local_link_problem(href, path))]
    problems += [f"{name}: raw {raw!r} in the text" for raw in RAW if raw in found["text"]]
    problems += [f"{name}: MathJax left untypeset: {m!r}" for m in found["untypeset"]]
    problems += [f"{name}: MathJax error: {m!r}" for m in found["mathErrors"]]
    problems += [f"{name}: JavaScript console: {m}" for m in console]
    notes += [f"{name}: cross-reference not a link: {ref!r}" for ref in found["crossRefs"]]
    notes += [f"{name}: equation wider than the column: {m!r}" for m in found["wideMath"]]
    for figure in found["figures"]:
        pt = figure_text_pt(figure)
        if pt is not None and pt < MIN_PT:
            image = Path(unquote(urlsplit(figure["src"]).path)).name
            notes.append(
                f"{name}: {image}: text ~{pt:.1f} pt at {figure['shown']:.0f} of {figure['natural']} px"
            )
    if screenshot is not None:
        page.screenshot(path=str(screenshot), full_page=True)
    page.close()
    return problems, notes, screenshot is not None


def test_every_page_reads_offline():
    out = SCREENSHOTS / "book"
    out.mkdir(parents=True, exist_ok=True)
    problems, notes, shots = [], [], 0
    with browser() as chromium:
        context = chromium.new_context(viewport=VIEWPORT, offline=True)
        for path in pages():
            name = str(path.relative_to(HTML))
            shot = out / (re.sub(r"[/\\]", "__", name)[: -len(".html")] + ".png")
            found_problems, found_notes, shot_taken = read_page(context, path, shot)
            problems += found_problems
            notes += found_notes
            shots += shot_taken
        context.close()
    notes += fixed_font_notes()
    (SCREENSHOTS / "readability.txt").write_text(
        f"Readability notes at a {VIEWPORT['width']} px wide window: figure text under {MIN_PT} pt (estimated from"
        " kvlab.plot's font size and the image's scale), chapter cross-references that are not links.\n"
        + "".join(f"{note}\n" for note in notes)
    )
    print(f"\n{shots} pages checked, screenshots in {out.relative_to(ROOT)}; {len(notes)} readability notes")
    assert shots > 0
    assert not problems, "\n".join(problems)
