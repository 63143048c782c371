"""The whole book as one PDF, built offline from the labs' stored outputs (`make pdf`).

python tools/pdf.py [--out _build/pdf/kvlab.pdf] [--work _build/pdf]

1. Jupyter Book's `singlehtml` builder renders every page into one HTML file, with the stored-outputs config
   that `make book-checked` uses (tools/book_config.py: no lab is executed) and the offline MathJax that
   _ext/kvlab_offline.py copies into the build.
2. Headless Chromium (tools/chromium.py: Debian's chromium through Playwright) opens that file with no network,
   loads every image, waits until MathJax has typeset every equation, and prints it to PDF (Chromium's
   print-to-PDF, A4, backgrounds kept so that figures and admonitions print as on screen).

tests/test_pdf.py builds it and reads it back with pdftotext.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import book_config  # noqa: E402
import chromium  # noqa: E402

# Runs in the page before printing: every image loaded (lazy ones too) and every equation typeset.
READY = r"""
async () => {
  const images = Array.from(document.images);
  await Promise.all(images.map((img) => { img.loading = "eager"; return img.decode().catch(() => null); }));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  const broken = images.filter((img) => !img.complete || img.naturalWidth === 0).map((img) => img.src);
  const untypeset = Array.from(document.querySelectorAll(".math")).filter((m) => !m.querySelector("mjx-container"));
  return {images: images.length, broken, untypeset: untypeset.length};
}
"""
REDIRECT = re.compile(r'http-equiv="Refresh" content="0; url=([^"]+)"', re.IGNORECASE)
# Print layout: the page is the article alone (no navigation bars or sidebars), figures never split.
PRINT_CSS = """
@page { size: A4; margin: 16mm 14mm; }
.bd-header, .bd-sidebar-primary, .bd-sidebar-secondary, .bd-header-article, .bd-footer, .bd-footer-article,
.prev-next-area, .header-article-items, #pst-back-to-top, .skip-link { display: none !important; }
.bd-main .bd-content .bd-article-container { max-width: 100% !important; }
img, figure { break-inside: avoid; }
/* A code cell or its output moves to the next page whole, unless it is longer than a page. */
.cell_input, .cell_output { break-inside: avoid; }
/* Code and outputs wrap at the page edge instead of being cut off there. */
pre { white-space: pre-wrap !important; overflow-wrap: anywhere; overflow: visible !important; }
/* Each document of the book (a chapter's page, its lab) starts on a new page: singlehtml marks where. */
span[id^="document-"] + section { break-before: page; }
"""


def english_toc() -> dict:
    """The English edition's table of contents (_toc.yml), never a Chinese page: the PDF is the English edition,
    and the machines that print it carry no CJK font (a Chinese page would print as empty boxes). The Chinese
    edition has its own table (_toc_zh.yml, _ext/kvlab_edition.py), which the PDF leaves out; the English pages'
    link to it (中文版) is HTML-only."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    for part in toc["parts"]:
        part["chapters"] = [c for c in part["chapters"] if not c["file"].startswith("book/zh/")]
    return toc


def build_singlehtml(work: Path) -> Path:
    """Render the book into `work`/_build/singlehtml/index.html from the stored outputs; that file's path."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / "_config.stored.yml"
    config.write_text(yaml.safe_dump(book_config.stored_config(), sort_keys=False))
    toc = work / "_toc.yml"
    toc.write_text(yaml.safe_dump(english_toc(), sort_keys=False))
    jupyter_book = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(jupyter_book), "build", str(ROOT), "--all", "--builder", "singlehtml"]
    cmd += ["--config", str(config), "--toc", str(toc), "--path-output", str(work)]
    cmd += ["-W", "-n", "--keep-going", "-q"]
    subprocess.run(cmd, check=True, cwd=ROOT)
    out = work / "_build" / "singlehtml"
    # index.html only forwards to the root document, book/intro.html, whose links Sphinx writes two ways:
    # `../_images/...` (glued figures) and `_images/...`, `_static/...` (notebook outputs, scripts). Links in
    # book/ make both resolve.
    page = out / REDIRECT.search((out / "index.html").read_text()).group(1)
    for name in ("_images", "_static"):
        link = page.parent / name
        if not link.exists():
            link.symlink_to(Path("..", name))
    return page


def print_pdf(html: Path, out: Path) -> dict:
    """Print `html` to `out` in headless Chromium once its images and equations are ready; what READY saw."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with chromium.browser() as browser:
        context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.goto(html.as_uri(), wait_until="load", timeout=300_000)
        page.add_style_tag(content=PRINT_CSS)
        ready = page.evaluate(READY)
        page.emulate_media(media="print")
        # At 0.8 the A4 column is 860 CSS px wide, wider than the web page's: what fits there fits here.
        page.pdf(
            path=str(out),
            scale=0.8,
            prefer_css_page_size=True,
            print_background=True,
            outline=True,
            tagged=True,
        )
        context.close()
    if ready["broken"] or ready["untypeset"]:
        raise RuntimeError(
            f"{html}: {len(ready['broken'])} images did not load, {ready['untypeset']} equations untypeset"
        )
    return ready


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "pdf" / "kvlab.pdf")
    parser.add_argument("--work", type=Path, default=ROOT / "_build" / "pdf")
    args = parser.parse_args(argv)
    if chromium.executable() is None:
        sys.exit(chromium.INSTALL_HINT)
    start = time.perf_counter()
    html = build_singlehtml(args.work.resolve())
    built = time.perf_counter() - start
    ready = print_pdf(html, args.out.resolve())
    print(
        f"{args.out}: {ready['images']} images; singlehtml {built:.0f} s, "
        f"printed in {time.perf_counter() - start - built:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
