"""The built book, read in headless Chromium from disk with no network (`make browser`, after `make book`).

Per page of _build/html, at a 1280 px laptop window: every image loads; every local link and anchor resolves; no
raw `\\(`, `\\[`, `$$` or `{glue` is left in the text; MathJax typeset every equation; no JavaScript error; no code
cell (`div.highlight pre`) or table wider than its box; and every raster figure in the article was drawn by
kvlab.book.plot (its PNG carries kvlab's text chunks), has no legend on its data and no colliding labels, and shows
its smallest text at 11 CSS px or more: that text's points (from the chunks) x dpi / 72 (pHYs) x the width the
page shows the image / its natural width. A second pass at a 412 px phone window asks for 9 CSS px (figures
keep a minimum width there and scroll: _ext/static/kvlab_figures.css). At both widths, a figure or table wider
than its column must not be cut silently: its box scrolls and a visible line above it says so
(_ext/static/kvlab_figures.js; a prose table is stacked instead). SVG diagrams have their own test
(tools/browser_diagrams.py). Full-page screenshots go to _build/screenshots/book/ and book-phone/.
Reported, not asserted, in _build/screenshots/readability.txt: "chapter N" references that are not links,
display equations wider than the column, and code cells or tables that scroll at the phone width.

Run explicitly (`pytest tools/browser_book.py`): it needs the book built first.
"""

import os
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from chromium import ROOT, SCREENSHOTS, browser

from kvlab.book import plot

HTML = Path(os.environ.get("KVLAB_BOOK_HTML", ROOT / "_build" / "html")).resolve()  # the built book
VIEWPORT = {"width": 1280, "height": 900}  # a laptop screen; the book's column is what it is at this width
PHONE = {"width": 412, "height": 915}  # a common Android phone's CSS viewport
LAPTOP_MIN_TEXT_PX = 11.0  # smallest figure text a reader sees at the laptop window, in CSS px
PHONE_MIN_TEXT_PX = 9.0  # and at the phone window, where a figure may scroll sideways instead
OVERFLOW_PX = 1  # a code cell or table this much wider than its box scrolls (or is cut)
SKIP = {"genindex.html"}  # generated, no content of ours
RAW = [r"\(", r"\[", "$$", "{glue"]
ZH_EDITION = "zh"  # the Chinese edition's folder in the built site

PAGE_CHECKS = r"""
async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  const images = Array.from(document.images);
  await Promise.all(images.map((img) => { img.loading = "eager"; return img.decode().catch(() => null); }));
  // A few frames for the page's own scripts to lay out what the loads changed (kvlab_figures.js)
  for (let frame = 0; frame < 3; frame++) await new Promise((done) => requestAnimationFrame(done));
  const broken = images.filter((img) => !img.complete || img.naturalWidth === 0).map((img) => img.src);
  // Raster figures the reader sees: SVG diagrams are checked by tools/browser_diagrams.py; an image in a
  // collapsed block has no box.
  const figures = images.filter((img) => img.naturalWidth > 0 && img.closest("article")
      && !/\.svg$/i.test(new URL(img.src).pathname) && img.getBoundingClientRect().width > 0)
    .map((img) => ({src: img.src, natural: img.naturalWidth, shown: img.getBoundingClientRect().width}));
  // A code cell scrolls when its text is wider than it; a table when it is wider than the box that holds it.
  // What must fit: a lab's code-cell input (the labs hold lines to 88 characters), and any table that nothing
  // lets the reader scroll to (cut at the page). A printed output line or a shell command in the prose that
  // scrolls inside its own box is only noted.
  const scrolls = (el) => {
    for (let up = el.parentElement; up && up.tagName !== "ARTICLE"; up = up.parentElement) {
      if (["auto", "scroll"].includes(getComputedStyle(up).overflowX)) return up;
    }
    return null;
  };
  const overflows = Array.from(document.querySelectorAll("article div.highlight pre, article table"))
    .filter((el) => el.getBoundingClientRect().width > 0)
    .map((el) => {
      const table = el.tagName === "TABLE";
      const box = table ? el.parentElement : el;
      const lines = el.innerText.split("\n");
      const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), "");
      const input = !table && el.closest(".cell_input") !== null;
      return {kind: table ? "table" : (input ? "code cell" : "printed or command block"),
        over: Math.max(el.scrollWidth - el.clientWidth, el.scrollWidth - box.clientWidth),
        text: (table ? lines[0] : longest).slice(0, 70), must_fit: input || (table && !scrolls(el))};
    });
  // A figure or table wider than what shows it: the part past the right edge of the box that scrolls it (or of
  // the window, or of a box that clips it, when nothing scrolls). The reader must be told that it scrolls: a
  // visible line right above that box (_ext/static/kvlab_figures.js writes it).
  const hinted = (box) => {
    const hint = box.previousElementSibling;
    return hint !== null && hint.classList.contains("kvlab-scroll-hint") && hint.getBoundingClientRect().height > 0
      && hint.innerText.trim() !== "";
  };
  const rightEdge = (el) => {
    let edge = document.documentElement.clientWidth;
    for (let up = el.parentElement; up; up = up.parentElement) {
      if (["hidden", "clip"].includes(getComputedStyle(up).overflowX)) {
        edge = Math.min(edge, up.getBoundingClientRect().left + up.clientLeft + up.clientWidth);
      }
    }
    return edge;
  };
  const caption = (img) => {
    const next = document.evaluate("following::p[1]", img, null, XPathResult.FIRST_ORDERED_NODE_TYPE, null)
      .singleNodeValue;
    const found = next && next.innerText.match(/^(?:Figure|Diagram|示意图|图)\s*[0-9.]*[0-9]/);
    return found ? found[0] + " " : "";
  };
  const cut = Array.from(document.querySelectorAll("article table, article img"))
    .filter((el) => el.getBoundingClientRect().width > 0 && !el.closest(".kvlab-jupyterlab-only"))
    .map((el) => {
      const box = scrolls(el);
      const edge = box ? box.getBoundingClientRect().left + box.clientLeft + box.clientWidth : rightEdge(el);
      const table = el.tagName === "TABLE";
      return {kind: table ? "table" : "figure", scrolls: box !== null, hinted: box !== null && hinted(box),
        hidden: Math.round(el.getBoundingClientRect().right - edge),
        what: table ? el.innerText.split("\n")[0].slice(0, 70)
          : caption(el) + new URL(el.src).pathname.split("/").pop().slice(0, 24)};
    });
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
  return {broken, figures, overflows, cut, links, maths: maths.length, untypeset, mathErrors, text, crossRefs,
    wideMath};
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


def min_text_px(window_width: int) -> float:
    """The smallest figure text, in CSS px, a window this wide must show: the laptop's, or the phone's below it."""
    return LAPTOP_MIN_TEXT_PX if window_width >= VIEWPORT["width"] else PHONE_MIN_TEXT_PX


def figure_problems(figure: dict, window_width: int) -> list[str]:
    """What is wrong with one raster figure as a window `window_width` px wide shows it.

    `figure` is what the page reports: its `src` (a file:// URL), `natural` width in image px and `shown` width
    in CSS px. The text size needs the chunks kvlab.book.plot writes; the overlaps they record do not depend on the
    window, so they are reported at the laptop width only."""
    parts = urlsplit(figure["src"])
    image = Path(unquote(parts.path)).name
    if parts.scheme != "file":
        return [f"{image}: not a file of the built book ({figure['src']})"]
    try:
        found = plot.read_png(Path(unquote(parts.path)).read_bytes())
    except (ValueError, OSError) as error:  # not a PNG, or not an image at all
        return [f"{image}: {error}"]
    laptop = window_width >= VIEWPORT["width"]
    if found is None:
        return (
            [f"{image}: no kvlab chunks, so not drawn by kvlab.book.plot: make it with plot.figure()"]
            if laptop
            else []
        )
    problems = []
    shown, natural = figure["shown"], figure["natural"]
    px = found.text_px(shown, natural)
    if px < min_text_px(window_width):
        problems.append(
            f"{image}: smallest text {px:.1f} CSS px at a {window_width} px window, under "
            f"{min_text_px(window_width):g} ({found.min_text_pt:g} pt at {found.dpi:.0f} dpi, "
            f"{natural} px shown {shown:.0f} px wide)"
        )
    if laptop:
        problems += [f"{image}: legend on the data: {overlap}" for overlap in found.legend_overlaps]
        problems += [f"{image}: labels collide: {collision}" for collision in found.text_collisions]
    return problems


def overflow_lines(overflows: list[dict], window_width: int, must_fit: bool = True) -> list[str]:
    """Each code cell or table wider than its box by more than OVERFLOW_PX, as the page reports them: those that
    must fit (a code-cell input, a table nothing scrolls), or, with `must_fit=False`, those that may scroll."""
    return [
        f"{o['kind']} {o['over']} px wider than its box at a {window_width} px window: {o['text']!r}"
        for o in overflows
        if o["over"] > OVERFLOW_PX and bool(o.get("must_fit", True)) == must_fit
    ]


def cut_lines(cut: list[dict], window_width: int) -> list[str]:
    """Each figure or table the page shows only in part with nothing telling the reader so: more than OVERFLOW_PX
    of it lies past the right edge of its box, and either no line above that box says it scrolls sideways, or
    nothing scrolls at all (the rest is out of reach)."""
    return [
        f"{c['kind']} {c['what']!r}: {c['hidden']} px of it cut off at the right at a {window_width} px window, "
        + ("and no line above it says it scrolls sideways" if c["scrolls"] else "with nothing to scroll it")
        for c in cut
        if c["hidden"] > OVERFLOW_PX and not (c["scrolls"] and c["hinted"])
    ]


def write_notes(title: str, notes: list[str]) -> None:
    """Replace this window's section of readability.txt (each browser pass owns one section)."""
    path = SCREENSHOTS / "readability.txt"
    sections = re.split(r"(?m)^(?=## )", path.read_text()) if path.is_file() else []
    kept = [part for part in sections if part.startswith("## ") and not part.startswith(f"## {title}\n")]
    kept.append(f"## {title}\n" + "".join(f"{note}\n" for note in notes))
    path.write_text("".join(part if part.endswith("\n") else part + "\n" for part in sorted(kept)))


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
    width = page.viewport_size["width"]
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
    problems += [f"{name}: {p}" for figure in found["figures"] for p in figure_problems(figure, width)]
    problems += [f"{name}: {line}" for line in cut_lines(found["cut"], width)]
    wide = [f"{name}: {line}" for line in overflow_lines(found["overflows"], width)]
    notes += [f"{name}: {line}" for line in overflow_lines(found["overflows"], width, must_fit=False)]
    # Code cells and unscrollable tables must fit the laptop's column; on a phone they may scroll sideways.
    if width >= VIEWPORT["width"]:
        problems += wide
    else:
        notes += wide
    if screenshot is not None:
        page.screenshot(path=str(screenshot), full_page=True)
    page.close()
    return problems, notes, screenshot is not None


def read_book(viewport: dict, screenshots: str) -> tuple[list[str], list[str], int]:
    """Every page of the English edition at one window size: (problems, notes, screenshots saved)."""
    out = SCREENSHOTS / screenshots
    out.mkdir(parents=True, exist_ok=True)
    problems, notes, shots = [], [], 0
    with browser() as chromium:
        context = chromium.new_context(viewport=viewport, offline=True)
        for path in pages():
            name = str(path.relative_to(HTML))
            shot = out / (re.sub(r"[/\\]", "__", name)[: -len(".html")] + ".png")
            found_problems, found_notes, shot_taken = read_page(context, path, shot)
            problems += found_problems
            notes += found_notes
            shots += shot_taken
        context.close()
    print(f"\n{shots} pages at {viewport['width']} px, screenshots in {out}; {len(notes)} notes")
    return problems, notes, shots


def check_book(viewport: dict, screenshots: str, notes_title: str) -> None:
    """One pass over the book at one window size: its notes into readability.txt, its problems asserted."""
    problems, notes, shots = read_book(viewport, screenshots)
    write_notes(notes_title, notes)
    assert shots > 0
    assert not problems, "\n".join(problems)


STATIC = ROOT / "_ext" / "static"  # kvlab_figures.css and .js, as the book's pages load them
WIDE_PAGE = """<!DOCTYPE html>
<html lang="{lang}"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="{static}/kvlab_figures.css">
<style>body {{ margin: 0; }} article {{ padding: 0 16px; }} td, th {{ padding: 0.25rem 0.5rem; }}
.pst-scrollable-table-container {{ overflow-x: auto; }}</style>
{script}</head><body><article>
<p><img src="_images/wide.png"></p>
<p><strong>Figure 1.</strong> A two-panel figure as kvlab.book.plot draws it, the column wide.</p>
<div class="pst-scrollable-table-container"><table class="table" id="errors">
<thead><tr><th>The log says</th><th>The term</th><th>What helps</th></tr></thead>
<tbody><tr><td><code>check_enough_kv_cache_memory</code> fails</td><td>the pool holds less than one
<code>max_model_len</code> sequence</td><td>a smaller <code>--max-num-batched-tokens</code></td></tr></tbody>
</table></div>
<div class="pst-scrollable-table-container"><table class="table" id="narrow">
<thead><tr><th>Term</th><th>Bytes</th></tr></thead><tbody><tr><td>weights</td><td>15 GiB</td></tr></tbody>
</table></div>
<div class="cell_output"><div class="output"><table id="printed"><tr>{numbers}</tr></table></div></div>
</article></body></html>"""


def wide_page(folder: Path, lang: str, script: bool) -> Path:
    """A page holding what a phone cannot show whole: a column-wide two-panel figure (1075 px), a three-column
    table of the prose like chapter 5's start-up errors, a narrow table, and a wide table a lab prints."""
    from PIL import Image

    (folder / "_images").mkdir(exist_ok=True)
    Image.new("RGB", (int(plot.COLUMN_INCHES * plot.DPI), 400), "white").save(folder / "_images" / "wide.png")
    page = folder / f"wide-{lang}-{int(script)}.html"
    tag = f'<script defer src="{STATIC.as_uri()}/kvlab_figures.js"></script>' if script else ""
    numbers = "".join(f"<td>{123456.789 + i}</td>" for i in range(20))
    page.write_text(WIDE_PAGE.format(lang=lang, static=STATIC.as_uri(), script=tag, numbers=numbers))
    return page


def test_what_is_wider_than_a_phone_stacks_or_says_it_scrolls(tmp_path):
    """kvlab_figures.js on a page of its own: at 412 px the prose table is stacked, the figure and the printed
    table each get a line saying they scroll (in the page's language), so nothing is cut silently; without the
    script the same page fails the check; at 1280 px only the printed table still scrolls."""
    with browser() as chromium:
        found = {}
        for width, lang, script in [
            (412, "en", True),
            (412, "zh-CN", True),
            (412, "en", False),
            (1280, "en", True),
        ]:
            context = chromium.new_context(viewport={"width": width, "height": 900}, offline=True)
            page = context.new_page()
            page.goto(wide_page(tmp_path, lang, script).as_uri(), wait_until="load")
            report = page.evaluate(PAGE_CHECKS)
            layout = page.evaluate(
                """() => ({
                  stacked: Array.from(document.querySelectorAll("table.kvlab-stacked")).map((t) => t.id),
                  hints: Array.from(document.querySelectorAll(".kvlab-scroll-hint:not([hidden])"))
                    .map((h) => h.innerText),
                  helps: document.querySelector("#errors td:nth-child(3)").getBoundingClientRect().right,
                })"""
            )
            found[(width, lang, script)] = (cut_lines(report["cut"], width), layout)
            context.close()
    cut, layout = found[(412, "en", True)]
    assert cut == [] and layout["stacked"] == ["errors"] and layout["helps"] <= 412 - 16
    assert layout["hints"] == ["Scroll sideways to see the rest →"] * 2
    cut, layout = found[(412, "zh-CN", True)]
    assert cut == [] and layout["hints"] == ["左右滑动查看其余部分 →"] * 2
    cut, _ = found[(412, "en", False)]
    assert [line.split(" ")[0] for line in cut] == ["figure", "table", "table"], cut
    assert cut[0].startswith("figure 'Figure 1 wide.png'") and "The log says" in cut[1]
    cut, layout = found[(1280, "en", True)]
    assert cut == [] and layout["stacked"] == [] and len(layout["hints"]) == 1


def test_every_page_reads_offline():
    check_book(
        VIEWPORT,
        "book",
        f"At a {VIEWPORT['width']} px window: chapter cross-references that are not links, equations wider "
        "than the column",
    )


def test_figures_read_on_a_phone():
    check_book(
        PHONE,
        "book-phone",
        f"At a {PHONE['width']} px phone window: code cells and tables that scroll sideways, chapter "
        "cross-references that are not links, equations wider than the column",
    )
