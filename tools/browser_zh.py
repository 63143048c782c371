"""The Chinese edition (_build/html/zh, `make book-zh`) read in headless Chromium offline (`make browser`).

Every page of it gets tools/browser_book.py's checks (images load, local links and anchors resolve, MathJax
typeset every equation, no raw `{glue` or TeX left, no JavaScript error) and a full-page screenshot under
_build/screenshots/zh/ at 1280 px; the intro and three chapters also at 412 px, a phone's width (where a figure or
table cut at the column must say that it scrolls, as tools/browser_book.py checks). Beyond those:
each page is marked Chinese (`lang="zh-CN"`), links the same page of the English edition at its top, and has a
Chinese sidebar; and a CJK font is installed, without which the screenshots show empty boxes for every 汉字.

Run explicitly (`pytest tools/browser_zh.py`): it needs both editions built first (`make book`).
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from browser_book import HTML, PHONE, SKIP, VIEWPORT, read_page
from chromium import ROOT, SCREENSHOTS, browser

ZH_HTML = HTML / "zh"
# The pages shown at both widths: the intro and three chapters (one with equations and figures, one with tables,
# and chapter 5, whose two-panel figures scroll and whose start-up-error table stacks at a phone's width).
BOTH_WIDTHS = (
    "book/zh/intro.html",
    "book/zh/02_sizing.html",
    "book/zh/05_active_tokens.html",
    "book/zh/07_paging.html",
)
HANZI = re.compile(r"[\u4e00-\u9fff]")
GENERATED = {"search.html"}  # Sphinx's search page: not a page of the book, it has no counterpart

ZH_CHECKS = r"""
() => {
  const edition = document.querySelector("nav.kvlab-edition a");
  const sidebar = document.querySelector(".bd-sidebar-primary");
  return {
    lang: document.documentElement.lang,
    edition: edition ? edition.href : null,
    sidebar: sidebar ? sidebar.innerText : "",
  };
}
"""


def zh_pages() -> list[Path]:
    if not (ZH_HTML / "index.html").is_file():
        pytest.fail(
            "no Chinese edition in _build/html/zh: run `make book` (or `make book-zh`)", pytrace=False
        )
    return sorted(p for p in ZH_HTML.rglob("*.html") if "_static" not in p.parts and p.name not in SKIP)


def cjk_fonts() -> list[str]:
    """The installed fonts that cover Chinese (fontconfig), e.g. Noto Sans CJK SC from fonts-noto-cjk."""
    if shutil.which("fc-list") is None:
        return []
    listed = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True, check=False)
    return [line for line in listed.stdout.splitlines() if line.strip()]


def shot_name(path: Path, width: int) -> str:
    return re.sub(r"[/\\]", "__", str(path.relative_to(ZH_HTML)))[: -len(".html")] + f"-{width}.png"


def test_a_cjk_font_is_installed():
    assert cjk_fonts(), "no font covers Chinese: apt-get install fonts-noto-cjk (.ci/system-packages does)"


def test_every_chinese_page_reads_offline():
    out = SCREENSHOTS / "zh"
    out.mkdir(parents=True, exist_ok=True)
    problems, shots = [], 0
    with browser() as chromium:
        for viewport in (VIEWPORT, PHONE):
            context = chromium.new_context(viewport=viewport, offline=True)
            for path in zh_pages():
                name = str(path.relative_to(ZH_HTML))
                if viewport is PHONE and name not in BOTH_WIDTHS:
                    continue
                found_problems, _, shot_taken = read_page(
                    context, path, out / shot_name(path, viewport["width"])
                )
                problems += found_problems
                shots += shot_taken
                if not shot_taken or viewport is PHONE:
                    continue  # a redirect page; or seen at the laptop width already
                page = context.new_page()
                page.goto(path.as_uri(), wait_until="load")
                found = page.evaluate(ZH_CHECKS)
                page.close()
                if found["lang"] != "zh-CN":
                    problems.append(f"zh/{name}: lang={found['lang']!r}, not zh-CN")
                if name not in GENERATED and (
                    not found["edition"] or found["edition"].startswith(ZH_HTML.as_uri())
                ):
                    problems.append(f"zh/{name}: no link to its English page at the top ({found['edition']})")
                if not HANZI.search(found["sidebar"]):
                    problems.append(f"zh/{name}: the sidebar has no Chinese text")
            context.close()
    print(f"\n{shots} screenshots of the Chinese edition in {out.relative_to(ROOT)}")
    assert shots >= len(BOTH_WIDTHS) * 2
    assert not problems, "\n".join(problems)
