"""How long the Chinese edition's sentences run, in 汉字, read from the built HTML (tools/prose.py's counterpart).

The visible prose is what tools/prose.py reads (paragraphs, list items, captions; not code, math, tables,
headings or folded blocks). A Chinese sentence ends at 。！？ (or at a Latin stop before a space);
its length is its count of CJK ideographs, so that Latin terms (KV Cache, Prefill), numbers and code do not count.

    .venv/bin/python tools/prose_zh.py     # every Chinese page of _build/html/zh, with its longest sentence

`make browser` runs this file's test: on every Chinese page sentences average 40 汉字 or fewer, and none runs
over 100.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from prose import assert_sentence_limits, html_blocks

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html" / "zh"
MAX_MEAN_CHARS = 40
MAX_SENTENCE_CHARS = 100
HANZI = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# A sentence ends at a full stop, question or exclamation mark (full-width or not), with any closing quote or
# bracket that follows; a Latin full stop only when a space or the end follows (not 1.5 or kvlab.costs.budget).
_END = re.compile(r"(?<=[。！？!?])[」』”’）)]*|(?<=\.)(?=\s|$)")


def sentences(text: str) -> list[str]:
    """The sentences of one block of Chinese text; a fragment with no 汉字 (a formula, a command) is none."""
    parts = [p.strip() for p in _END.split(text)]
    return [p for p in parts if HANZI.search(p)]


def hanzi(text: str) -> int:
    return len(HANZI.findall(text))


def chinese_pages(html: Path = HTML) -> list[Path]:
    """The Chinese pages as built (book/zh/*.html), not the English labs the edition carries."""
    return sorted((html / "book" / "zh").glob("*.html"))


def sentence_lengths(page: Path) -> list[tuple[int, str]]:
    return [(hanzi(s), s) for b in html_blocks(page.read_text()) for s in sentences(b.text)]


def main() -> int:
    pages = chinese_pages()
    if not pages:
        print(f"no Chinese pages under {HTML}: run `make book-zh` first")
        return 1
    print(f"{'page':26} {'sentences':>9} {'mean':>5} {'longest':>7}")
    for page in pages:
        lengths = sentence_lengths(page)
        mean = sum(n for n, _ in lengths) / len(lengths) if lengths else 0.0
        longest = max(lengths, default=(0, ""))
        print(f"{page.stem:26} {len(lengths):>9} {mean:>5.1f} {longest[0]:>7}  {longest[1][:60]}")
    return 0


def test_sentences_end_at_chinese_stops_and_count_hanzi_only():
    text = "缓存只存 K 和 V。每个 token 128 KiB！为什么？见 kvlab.costs.budget 和 1.5 GiB。"
    assert sentences(text) == [
        "缓存只存 K 和 V。",
        "每个 token 128 KiB！",
        "为什么？",
        "见 kvlab.costs.budget 和 1.5 GiB。",
    ]
    assert hanzi("每个 token 128 KiB，KV Cache 的显存") == 5
    assert sentences("$ vllm serve model") == []


@pytest.mark.parametrize("page", chinese_pages(), ids=lambda p: p.stem)
def test_chinese_sentences_within_limits(page):
    lengths = sentence_lengths(page)
    assert lengths, f"{page.name}: no Chinese sentence read"
    longest, longest_text = max(lengths)
    mean = sum(n for n, _ in lengths) / len(lengths)
    assert_sentence_limits(longest, longest_text, mean, "汉字", MAX_SENTENCE_CHARS, MAX_MEAN_CHARS)


def test_the_chinese_edition_is_built():
    assert chinese_pages(), f"no Chinese pages under {HTML}: run `make book` (it builds both editions)"


if __name__ == "__main__":
    sys.exit(main())
