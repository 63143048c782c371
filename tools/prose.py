"""How long a chapter's visible prose is, and how long its sentences run, read from the built HTML.

Visible prose is what a reader meets without opening anything: paragraphs, list items and figure captions
of the page body. Code, math, tables, headings and folded blocks ("How this is checked", exercise answers)
are left out. Boxes (takeaways, "Try it on your vLLM") count for sentence length but not for the word goal,
which is about the running text.

    .venv/bin/python tools/prose.py                 # every chapter of _build/html, against the baseline
    .venv/bin/python tools/prose.py --markdown FILE  # a rough reading of a MyST source while writing

`make browser` runs this file's test: each chapter's running text is at least 30 % shorter than the
baseline (`tools/prose_baseline.json`, read from the book as built on 2026-12-01 before the rewrite), its
sentences average 22 words or fewer, and none runs over 60.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
BASELINE = Path(__file__).with_name("prose_baseline.json")
MAX_MEAN_WORDS = 22
MAX_SENTENCE_WORDS = 60
SHORTER_BY = 0.30
# Reference pages, not running text: the cheat sheet and glossary grow as terms are added, so only their
# sentence lengths are held to the limits.
REFERENCE_PAGES = {"appendix_cheat_sheet"}

# Tags whose text a reader does not read as prose.
SKIPPED_TAGS = {"pre", "table", "script", "style", "details", "h1", "h2", "h3", "h4", "h5", "h6", "nav"}
# Classes of the same: math, folded blocks, code cells and their outputs, the page's chrome.
SKIPPED_CLASSES = {
    "math",
    "dropdown",
    "toggle",
    "sd-dropdown",
    "cell_output",
    "cell_input",
    "headerlink",
    "footnote",
    "bd-sidebar",
    "prev-next-area",
}
BOX_CLASSES = {"admonition"}
BLOCK_TAGS = {"p", "li", "figcaption", "dd", "dt"}
VOID_TAGS = {"br", "img", "hr", "meta", "link", "input", "col", "source", "wbr"}


@dataclass
class Block:
    """One paragraph, list item or caption of visible text."""

    text: str
    boxed: bool


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, boxed)
        self.in_main = 0
        self.blocks: list[Block] = []
        self.current: list[str] = []
        self.block_depth = 0

    def _skipped(self) -> bool:
        return any(skipped for _, skipped, _ in self.stack)

    def _boxed(self) -> bool:
        return any(boxed for _, _, boxed in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID_TAGS:
            return
        classes = set((dict(attrs).get("class") or "").split())
        if tag == "main" or "bd-article" in classes:
            # The article holds the page's text; the theme's sidebars and footers sit outside it.
            self.in_main += 1
        skipped = tag in SKIPPED_TAGS or bool(classes & SKIPPED_CLASSES)
        self.stack.append((tag, skipped, bool(classes & BOX_CLASSES)))
        if tag in BLOCK_TAGS:
            self._flush()
            self.block_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID_TAGS or not any(t == tag for t, _, _ in self.stack):
            return
        if tag in BLOCK_TAGS:
            self._flush()
            self.block_depth -= 1
        while self.stack:
            t, _, _ = self.stack.pop()
            if t == tag:
                break
        if tag == "main":
            self.in_main -= 1

    def handle_data(self, data: str) -> None:
        if self.in_main and self.block_depth and not self._skipped():
            self.current.append(data)

    def _flush(self) -> None:
        text = " ".join("".join(self.current).split())
        if text:
            self.blocks.append(Block(text, self._boxed()))
        self.current = []


def html_blocks(html: str) -> list[Block]:
    """The visible prose blocks of one built page."""
    reader = _Reader()
    reader.feed(html)
    reader._flush()
    return reader.blocks


_FOLDED = re.compile(r"^(`{3,}|:{3,})\{(dropdown|toggle)\}.*?^\1\s*$", re.M | re.S)
_FOLDED_CLASS = re.compile(
    r"^(`{3,}|:{3,})\{[\w-]+\}[^\n]*\n(?::[^\n]*\n)*?:class:[^\n]*dropdown.*?^\1\s*$", re.M | re.S
)
_BOX = re.compile(r"^(`{3,}|:{3,})\{(admonition|note|tip|important|warning|seealso)\}", re.M)


def markdown_blocks(markdown: str) -> list[Block]:
    """A rough reading of a MyST page's visible prose, for use while writing (the test reads the HTML)."""
    text = _FOLDED.sub("", markdown)
    text = _FOLDED_CLASS.sub("", text)
    text = re.sub(r"^(`{3,})[^\n]*\n.*?^\1\s*$", "", text, flags=re.M | re.S)
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    blocks = []
    boxed = 0
    for para in re.split(r"\n\s*\n", text):
        lines = []
        para_boxed = False
        for line in para.splitlines():
            if _BOX.match(line):
                boxed += 1
                continue
            if re.match(r"^:{3,}\s*$", line):
                boxed = max(boxed - 1, 0)
                continue
            if re.match(r"^\s*(#|\||:\w+:|\(|\+\+\+|%)", line) or not line.strip():
                continue
            # A box's closing fence may follow its last line directly: the line is boxed when read.
            para_boxed = para_boxed or boxed > 0
            lines.append(re.sub(r"^\s*(?:[-*+]|\d+\.)\s+", "", line))
        body = " ".join(lines)
        body = re.sub(r"\{glue:?\w*\}`[^`]*`", "N", body)
        body = re.sub(r"\{\w+\}`([^`<]*?)(?:<[^>]*>)?`", r"\1", body)
        body = re.sub(r"\$[^$]+\$", "x", body)
        body = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", body)
        body = " ".join(body.replace("**", "").split())
        if body:
            blocks.append(Block(body, para_boxed))
    return blocks


_ABBREVIATIONS = ("e.g.", "i.e.", "vs.", "et al.", "cf.", "Fig.", "approx.", "no.", "etc.)")
_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9`*])")


def sentences(text: str) -> list[str]:
    """Split at a full stop, question or exclamation mark followed by a capital or digit; not at e.g. or vs."""
    guarded = text
    for i, abbr in enumerate(_ABBREVIATIONS):
        guarded = guarded.replace(abbr + " ", f"\0{i}\0 ")
    parts = [p.strip() for p in _END.split(guarded) if p.strip()]
    restored = []
    for part in parts:
        for i, abbr in enumerate(_ABBREVIATIONS):
            part = part.replace(f"\0{i}\0", abbr)
        restored.append(part)
    return restored


def words(text: str) -> int:
    return len(re.findall(r"[\w'’.,%×/+-]*\w[\w'’.,%×/+-]*", text))


@dataclass(frozen=True)
class ProseStats:
    running_words: int  # outside boxes: the text the 30 % goal shortens
    sentences: int
    mean_words: float  # per sentence, boxes included
    longest: int
    longest_text: str


def prose_stats(blocks: list[Block]) -> ProseStats:
    split = [s for b in blocks for s in sentences(b.text)]
    lengths = [words(s) for s in split]
    longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
    return ProseStats(
        running_words=sum(words(b.text) for b in blocks if not b.boxed),
        sentences=len(split),
        mean_words=sum(lengths) / len(lengths) if lengths else 0.0,
        longest=lengths[longest] if longest is not None else 0,
        longest_text=split[longest] if longest is not None else "",
    )


def chapter_pages(html: Path = HTML) -> list[Path]:
    """The chapters' prose pages (not the labs), the intro and the appendix, as built."""
    pages = sorted(html.glob("book/*/index.html"))
    return [html / "book" / "intro.html", *pages] if (html / "book" / "intro.html").exists() else pages


def page_key(page: Path) -> str:
    return page.parent.name if page.name == "index.html" else page.stem


def measure_book(html: Path = HTML) -> dict[str, ProseStats]:
    return {page_key(p): prose_stats(html_blocks(p.read_text())) for p in chapter_pages(html)}


def report(stats: dict[str, ProseStats], baseline: dict[str, dict[str, float]]) -> str:
    lines = [f"{'page':26} {'words':>6} {'before':>6} {'change':>7} {'mean':>5} {'before':>6} {'longest':>7}"]
    for key, s in stats.items():
        old = baseline.get(key, {})
        before = old.get("running_words")
        change = f"{s.running_words / before - 1:+.0%}" if before else "-"
        lines.append(
            f"{key:26} {s.running_words:>6} {before or '-':>6} {change:>7} {s.mean_words:>5.1f} "
            f"{old.get('mean_words', 0):>6.1f} {s.longest:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", nargs="+", type=Path, help="read these MyST files instead of the HTML")
    parser.add_argument("--html", type=Path, default=HTML)
    parser.add_argument(
        "--write-baseline", action="store_true", help="store this build's figures as the baseline"
    )
    parser.add_argument(
        "--long", type=int, default=MAX_SENTENCE_WORDS, help="print sentences over this many words"
    )
    args = parser.parse_args(argv)
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    if args.markdown:
        stats = {p.parent.name: prose_stats(markdown_blocks(p.read_text())) for p in args.markdown}
        blocks = {p.parent.name: markdown_blocks(p.read_text()) for p in args.markdown}
    else:
        stats = measure_book(args.html)
        blocks = {page_key(p): html_blocks(p.read_text()) for p in chapter_pages(args.html)}
    print(report(stats, baseline))
    for key, bs in blocks.items():
        for s in (s for b in bs for s in sentences(b.text)):
            if words(s) > args.long:
                print(f"\n{key}: {words(s)} words: {s}")
    if args.write_baseline:
        BASELINE.write_text(
            json.dumps(
                {
                    k: {
                        "running_words": s.running_words,
                        "mean_words": round(s.mean_words, 1),
                        "longest": s.longest,
                    }
                    for k, s in stats.items()
                },
                indent=1,
            )
            + "\n"
        )
    return 0


def assert_sentence_limits(
    longest: int, longest_text: str, mean: float, unit: str, max_longest: int, max_mean: float
) -> None:
    """One page's sentence-length limits, in `unit` (words here, 汉字 in tools/prose_zh.py)."""
    assert longest <= max_longest, f"{longest} {unit}: {longest_text}"
    assert mean <= max_mean, f"sentences average {mean:.1f} {unit}"


def test_sentences_split_at_stops_not_at_abbreviations():
    text = "The cache grows, e.g. with context. It holds 1.5 GiB per user. Why? Bandwidth."
    assert sentences(text) == [
        "The cache grows, e.g. with context.",
        "It holds 1.5 GiB per user.",
        "Why?",
        "Bandwidth.",
    ]
    assert words("A 128 KiB cache, 2 × 8 × 128.") == 7


def test_folded_blocks_code_and_math_are_not_prose():
    html = (
        '<main><p>One two three.</p><details class="sd-dropdown"><p>Hidden words here.</p></details>'
        '<pre>code code</pre><p>Four <span class="math">x^2</span> five.</p>'
        '<div class="admonition tip"><p>Boxed six.</p></div><h2>Title</h2></main>'
    )
    blocks = html_blocks(html)
    assert [(b.text, b.boxed) for b in blocks] == [
        ("One two three.", False),
        ("Four five.", False),
        ("Boxed six.", True),
    ]
    assert prose_stats(blocks).running_words == 5


@pytest.mark.parametrize("page", chapter_pages(), ids=page_key)
def test_visible_prose_within_limits(page):
    baseline = json.loads(BASELINE.read_text())
    stats = prose_stats(html_blocks(page.read_text()))
    key = page_key(page)
    assert_sentence_limits(
        stats.longest, stats.longest_text, stats.mean_words, "words", MAX_SENTENCE_WORDS, MAX_MEAN_WORDS
    )
    if key in baseline and key not in REFERENCE_PAGES:
        limit = (1 - SHORTER_BY) * baseline[key]["running_words"]
        assert stats.running_words <= limit, f"{stats.running_words} running words, goal {limit:.0f}"


if __name__ == "__main__":
    sys.exit(main())
