"""Every lab follows the book's conventions (see docs/conventions.md)."""

import json
import re
from pathlib import Path

import pytest
import repo_url

ROOT = Path(__file__).resolve().parents[1]
LABS = repo_url.notebooks()
TOC = (ROOT / "_toc.yml").read_text()


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def source(cell):
    return "".join(cell["source"])


IGNORE = "nbval-ignore-output"


def glued_names(path):
    """The names a lab's stored outputs glued (myst_nb writes each under metadata.scrapbook.name)."""
    return {
        o.get("metadata", {}).get("scrapbook", {}).get("name")
        for c in code_cells(path)
        for o in c.get("outputs", [])
    } - {None}


def tags(cell):
    return cell.get("metadata", {}).get("tags", [])


def compared(cell):
    return bool(cell.get("outputs")) and IGNORE not in tags(cell) and "nbval-skip" not in tags(cell)


def test_there_are_labs():
    assert len(LABS) >= 2


@pytest.mark.parametrize("lab", LABS, ids=lambda p: str(p.relative_to(ROOT)))
def test_lab_conventions(lab):
    cells = code_cells(lab)
    assert "parameters" in cells[0].get("metadata", {}).get("tags", []), (
        "first code cell is tagged parameters"
    )
    assert '"google.colab" in sys.modules' in source(cells[1]), "second cell installs kvlab on Colab only"
    provenance = next(c for c in cells if "env_report(" in source(c))
    assert IGNORE in tags(provenance), "the provenance cell differs on every machine: not compared"
    assert not any("NBVAL_" in source(c) for c in cells), "nbval markers are cell tags, not comments"
    assert all(c.get("execution_count") for c in cells), "committed with outputs from a full run"
    assert not any(o.get("output_type") == "error" for c in cells for o in c.get("outputs", []))
    assert any(re.search(r"^\s*assert ", source(c), re.M) for c in cells), "labs assert their claims"
    assert any(re.search(r"\bglue(_all)?\(", source(c)) for c in cells), "labs glue their numbers"
    text = "\n".join(source(c) for c in cells)
    assert "kvlab.pick_device()" in text, "labs pick cuda when available, else cpu"


def test_nbval_compares_at_least_40_percent_of_the_outputs():
    """Ignoring whole cells is not the way to a run that passes on every CPU: most outputs stay compared."""
    with_outputs = [c for lab in LABS for c in code_cells(lab) if c.get("outputs")]
    share = sum(map(compared, with_outputs)) / len(with_outputs)
    assert share >= 0.4, f"nbval compares {share:.0%} of the code cells with outputs"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: str(p.relative_to(ROOT)))
def test_chapter_page_and_lab_are_in_toc(lab):
    chapter = lab.parent.relative_to(ROOT)
    assert f"file: {chapter}/index" in TOC and f"file: {chapter}/lab" in TOC
    page = (lab.parent / "index.md").read_text()
    assert "src/kvlab/" in page, "each chapter links to its kvlab module"
    glued = glued_names(lab)
    for key in re.findall(r"lab\.ipynb::(\w+)", page):
        assert key in glued, f"{key} is glued by the lab (in its stored outputs)"


def test_repository_url_in_one_place():
    url = repo_url.configured_url()
    for lab in LABS:
        assert repo_url.notebook_urls(lab) <= {url}, lab


PAGES = sorted(p for p in (ROOT / "book").rglob("*.md") if not any(part.startswith(".") for part in p.parts))


def test_there_are_pages():
    assert len(PAGES) >= 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_line_starts_a_myst_comment(page):
    """MyST reads a line that begins with `%` as a comment and drops it from the page, silently."""
    fence = None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker and (fence is None or marker.group(1).startswith(fence)):
            fence = None if fence else marker.group(1)[:3]
            continue
        assert fence is not None or not stripped.startswith("%"), (
            f"{page.relative_to(ROOT)}:{number} begins with % and MyST drops it as a comment: {line!r}"
        )


@pytest.mark.parametrize(
    ("value", "decimals", "lower", "upper"),
    [
        (14.7, 0, "14", "15"),
        (14.7, 1, "14.7", "14.7"),
        (0.29, 2, "0.29", "0.29"),
        (4.0, 0, "4", "4"),
        (6401.3, 0, "6,401", "6,402"),
        (1.2345, 2, "1.23", "1.24"),
        (-1.5, 0, "-2", "-1"),
    ],
)
def test_bounds_are_never_rounded_the_wrong_way(value, decimals, lower, upper):
    """Prose says "at least" with `format_floor` and "at most" with `format_ceil` (kvlab.units)."""
    from kvlab.units import format_ceil, format_floor

    assert format_floor(value, decimals) == lower
    assert format_ceil(value, decimals) == upper
    assert float(lower.replace(",", "")) <= value <= float(upper.replace(",", ""))


def test_module_map_matches_the_code():
    # docs/modules.md, which the README links, names every module under src/kvlab, and only modules that exist.
    text = (ROOT / "docs" / "modules.md").read_text()
    # A table row names a module in its first cell; a section heading names its package.
    named = set(re.findall(r"^\| `(kvlab[a-z_.]*)`", text, re.M)) | set(
        re.findall(r"^## .*\(`(kvlab[a-z_.]*)`\)", text, re.M)
    )
    src = ROOT / "src"
    modules = {
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for p in (src / "kvlab").rglob("*.py")
        if not p.stem.startswith("_") or p.stem == "__init__"
    }
    assert named - modules == set(), "docs/modules.md names modules that do not exist"
    assert modules - {"kvlab", "kvlab.cli", "kvlab.env"} - named == set(), (
        "modules missing from docs/modules.md"
    )


def test_install_cells_pin_the_executed_kvlab():
    # Colab installs the kvlab a lab's outputs come from (tag v<kvlab.__version__>), not the default branch.
    import install_cell

    assert install_cell.stale(ROOT / "book") == []


CHAPTER_REFERENCE = re.compile(r"\b(chapters?\s+\d+(?:[-–]\d+)?|(?:next|previous)\s+chapter)\b", re.I)


def unlinked_chapter_references(markdown: str) -> list[str]:
    """ "chapter N", "chapters N and M", "next chapter" in prose outside a link, code or the page title.

    The same pattern as the browser check's readability note (tools/browser_book.py), on the Markdown source.
    """
    kept, fence = [], None
    for line in markdown.splitlines():
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker and fence is None and not stripped[len(marker[1]) :].startswith("{"):
            fence = marker[1]
        elif marker and fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None and not stripped.startswith("# "):
            kept.append(line)
    prose = "\n".join(kept)
    prose = re.sub(
        r"!?\[[^\]]*\]\([^)]*\)", " ", prose
    )  # links (a link's text is allowed to say "chapter 2")
    prose = re.sub(r"`[^`]*`", " ", prose)  # code spans and roles such as {glue:text}`...`
    return [" ".join(m[0].split()) for m in CHAPTER_REFERENCE.finditer(prose)]


def test_unlinked_chapter_references_are_found():
    text = "See chapter 2 and [chapter 3](../03/index.md), chapters\n5 and [6](x.md); the next chapter.\n"
    text += "```python\n# chapter 9 in code\n```\n`chapter 4`\n"
    assert unlinked_chapter_references(text) == ["chapter 2", "chapters 5", "next chapter"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_chapter_references_are_links(page):
    found = unlinked_chapter_references(page.read_text())
    assert found == [], (
        f"{page.relative_to(ROOT)}: link each chapter mention, e.g. [chapter 2](../02_sizing/index.md): {found}"
    )


SMALL_FONT = re.compile(
    r"""\b(?:fontsize|labelsize|titlesize)\s*=\s*(?:(\d+(?:\.\d+)?)\b|["'](xx-small|x-small|small|smaller)["'])"""
    r"""|["'](?:font\.size|[a-z]+\.(?:fontsize|labelsize|titlesize))["']\s*:\s*(\d+(?:\.\d+)?)\b"""
)


def small_fonts(code: str, minimum: float = 9.0) -> list[str]:
    """Fixed font sizes under `minimum` points (numbers, or matplotlib's named sizes below its 10 pt default)."""
    found = []
    for match in SMALL_FONT.finditer(code):
        number = match[1] or match[3]
        if match[2] or float(number) < minimum:
            found.append(match[0])
    return found


def test_small_fonts_are_found():
    code = 'ax.legend(fontsize=8)\nax.tick_params(labelsize=12)\nax.text(0, 0, "a", fontsize="small")\n'
    code += 'plt.rcParams.update({"legend.fontsize": 7.5})\nax.legend(fontsize=plot.compact_text())\n'
    assert small_fonts(code) == ["fontsize=8", 'fontsize="small"', '"legend.fontsize": 7.5']


@pytest.mark.parametrize("lab", LABS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_font_below_9_points_in_labs(lab):
    found = [f for cell in code_cells(lab) for f in small_fonts(source(cell))]
    assert found == [], (
        f"{lab.relative_to(ROOT)}: use kvlab.book.plot's style or plot.compact_text(), not {found}"
    )


def test_readme_reads_in_one_screen():
    # The README is the pitch, the two commands, the layout and the chapters; the rest lives in docs/.
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 8192, f"README.md is {len(readme.encode())} bytes, over 8 KB"
    assert readme.index("make book") < readme.index("## The chapters")
    for link in re.findall(r"\]\((docs/[^)]+)\)", readme):
        assert (ROOT / link).is_file(), f"README links {link}, which does not exist"
    chapters = sorted(p.parent.name for p in (ROOT / "book").glob("[0-9][0-9]_*/index.md"))
    listed = re.findall(r"^(\d+)\. \*\*", readme, flags=re.M)
    assert [int(n) for n in listed] == list(range(1, len(chapters) + 1)), "one line per chapter, in order"


def notebook_logic(code: str) -> list[str]:
    """The functions a lab cell defines that hold logic a test cannot reach: longer than 5 lines, or looping."""
    import ast

    lines = [line for line in code.splitlines() if not line.lstrip().startswith(("%", "!"))]
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        loops = any(isinstance(n, ast.For | ast.While | ast.comprehension) for n in ast.walk(node))
        if length > 5 or loops:
            found.append(f"def {node.name}: {length} lines{', a loop' if loops else ''}")
    return found


def test_notebook_logic_is_found():
    assert notebook_logic("def f(x):\n    return x + 1\n") == []
    assert notebook_logic("def f(xs):\n    return [x for x in xs]\n") == ["def f: 2 lines, a loop"]
    long = "def g():\n" + "    a = 1\n" * 5 + "    return a\n"
    assert notebook_logic(long) == ["def g: 7 lines"]
    assert notebook_logic("%matplotlib inline\nfor x in range(3):\n    pass\n") == []


@pytest.mark.parametrize("lab", LABS, ids=lambda p: str(p.relative_to(ROOT)))
def test_labs_define_no_logic_a_test_cannot_reach(lab):
    found = {i: notebook_logic(source(c)) for i, c in enumerate(code_cells(lab))}
    assert not {i: f for i, f in found.items() if f}, "lift these into kvlab, with tests"


# A lab reads as a page: cells a reader takes in at a glance, lines that fit the code cell at a 1280 px window
# (tools/browser_book.py checks the rendered width). The parameters cell is papermill's list of settings, one cell.
MAX_CELL_LINES = 30
MAX_LINE_CHARS = 88


def shown_code_cells(path):
    return [c for c in code_cells(path) if "remove-input" not in tags(c)]


def long_cells(path):
    """(cell id, lines) of each shown, non-parameters code cell over MAX_CELL_LINES lines."""
    return [
        (c.get("id"), len(source(c).splitlines()))
        for c in shown_code_cells(path)
        if "parameters" not in tags(c) and len(source(c).splitlines()) > MAX_CELL_LINES
    ]


def test_long_cells_and_lines_are_found():
    cell = {"cell_type": "code", "id": "x", "metadata": {}, "source": "a = 1\n" * (MAX_CELL_LINES + 1)}
    nb = ROOT / "_build" / "conventions-probe.ipynb"
    nb.parent.mkdir(exist_ok=True)
    nb.write_text(json.dumps({"cells": [cell]}))
    assert long_cells(nb) == [("x", MAX_CELL_LINES + 1)]


@pytest.mark.parametrize("lab", LABS, ids=lambda p: str(p.relative_to(ROOT)))
def test_labs_read_as_pages(lab):
    assert not long_cells(lab), f"split these cells (at most {MAX_CELL_LINES} lines): {long_cells(lab)}"
    wide = [
        (c.get("id"), line)
        for c in shown_code_cells(lab)
        for line in source(c).splitlines()
        if len(line) > MAX_LINE_CHARS
    ]
    assert not wide, f"code lines over {MAX_LINE_CHARS} characters: {wide[:3]}"
    cells = json.loads(lab.read_text())["cells"]
    unexplained = [
        c.get("id")
        for before, c in zip(cells, cells[1:], strict=False)
        if c["cell_type"] == "code"
        # setup cells (the install and imports cells) are hidden in the HTML: nothing to introduce
        and not {"remove-input", "hide-input"} & set(tags(c))
        and before["cell_type"] != "markdown"
    ]
    assert not unexplained, f"a sentence of prose goes above each code cell: {unexplained}"


def stored_figure_problems(path):
    """What kvlab.book.plot recorded in each stored figure of a lab: legends on the data, colliding labels."""
    import base64

    from kvlab.book import plot

    problems = []
    for i, cell in enumerate(code_cells(path)):
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            found = png and plot.read_png(base64.b64decode(png))
            if found:
                problems += [f"code cell {i}: {p}" for p in found.legend_overlaps + found.text_collisions]
    return problems


def test_stored_figure_problems_are_found(tmp_path):
    import base64

    import matplotlib.pyplot as plt

    from kvlab.book import plot

    fig, ax = plot.figure(height=1.2)
    ax.set_yticks(range(30), [f"model {i}" for i in range(30)])
    data = base64.b64encode(plot.png_bytes(fig)).decode()
    plt.close(fig)
    lab = tmp_path / "lab.ipynb"
    cell = {"cell_type": "code", "source": [], "outputs": [{"data": {"image/png": data}}]}
    lab.write_text(json.dumps({"cells": [cell]}))
    assert any("overlaps y tick label" in p for p in stored_figure_problems(lab))


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.parent.name)
def test_stored_figures_have_no_colliding_labels(lab):
    # The browser stage reports the same records; here they fail in seconds, before any lab runs.
    assert not stored_figure_problems(lab)


# A lab's outputs are read on a page: a cell whose text output runs past this many characters is a log, not a
# result (lab 15 once printed 100 KB of RequestOutput reprs). Figures and glued records are not text.
MAX_TEXT_OUTPUT_CHARS = 20_000


def text_output_chars(cell) -> int:
    total = 0
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            total += len("".join(output.get("text", "")))
        for mime, value in output.get("data", {}).items():
            if mime in ("text/plain", "text/html", "text/markdown"):
                total += len("".join(value) if isinstance(value, list) else str(value))
    return total


def only_glues(cell) -> bool:
    """Every statement of the cell is a call of glue or glue_all: it shows the reader nothing but plumbing."""
    import ast

    try:
        body = ast.parse(source(cell)).body
    except SyntaxError:
        return False
    return bool(body) and all(
        isinstance(s, ast.Expr)
        and isinstance(s.value, ast.Call)
        and isinstance(s.value.func, ast.Name)
        and s.value.func.id in ("glue", "glue_all")
        for s in body
    )


def test_glue_only_cells_and_long_outputs_are_found():
    glue_cell = {
        "cell_type": "code",
        "metadata": {},
        "source": 'glue("a", 1, display=False)\nglue_all({"b": 2})\n',
    }
    assert only_glues(glue_cell) and not only_glues(dict(glue_cell, source="x = 1\nglue('a', x)\n"))
    log = {"outputs": [{"output_type": "stream", "text": "x" * (MAX_TEXT_OUTPUT_CHARS + 1)}]}
    assert text_output_chars(log) > MAX_TEXT_OUTPUT_CHARS


@pytest.mark.parametrize("lab", LABS, ids=lambda p: str(p.relative_to(ROOT)))
def test_labs_end_as_pages_not_logs(lab):
    glue_only = [c.get("id") for c in shown_code_cells(lab) if only_glues(c)]
    assert not glue_only, f"tag these cells remove-input: they only glue values into the book: {glue_only}"
    long = [
        (c.get("id"), text_output_chars(c))
        for c in code_cells(lab)
        if text_output_chars(c) > MAX_TEXT_OUTPUT_CHARS
    ]
    assert not long, f"text outputs over {MAX_TEXT_OUTPUT_CHARS:,} characters: {long}"


# Labs that read as pages to the end (issue 51, section 3): every visible assert and every claim's attempt log sits
# in one closing section, and the last cell says what the reader saw and what to run next, with papermill -p.
CHECKS_HEADING = "## How this lab checks itself"
PAGE_LABS = ("08_continuous_batching", "12_beyond_hbm")


def claim_machinery_above_checks(path) -> list[str] | None:
    """Ids of the cells above the checks section that show an assert or print a claim's attempts; None if the lab
    has no checks section."""
    import ast

    from kvlab.claims import parse_attempts

    found = []
    for cell in json.loads(Path(path).read_text())["cells"]:
        if cell["cell_type"] == "markdown" and CHECKS_HEADING in source(cell):
            return found
        if cell["cell_type"] != "code":
            continue
        shown_assert = "remove-input" not in tags(cell) and any(
            isinstance(node, ast.Assert) for node in ast.walk(ast.parse(source(cell)))
        )
        printed = "".join(
            "".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream"
        )
        if shown_assert or parse_attempts(printed):
            found.append(cell.get("id"))
    return None


def test_claim_machinery_above_the_checks_is_found(tmp_path):
    def lab(*cells):
        path = tmp_path / "lab.ipynb"
        path.write_text(json.dumps({"cells": list(cells)}))
        return path

    heading = {"cell_type": "markdown", "source": CHECKS_HEADING + "\n"}
    shown = {"cell_type": "code", "id": "a", "metadata": {}, "source": "assert 1 < 2\n", "outputs": []}
    log = {"output_type": "stream", "text": "the claim, attempt 1/3: holds\n"}
    logged = {"cell_type": "code", "id": "b", "metadata": {}, "source": "x = 1\n", "outputs": [log]}
    hidden = dict(shown, metadata={"tags": ["remove-input"]})
    assert claim_machinery_above_checks(lab(shown, logged, heading)) == ["a", "b"]
    assert claim_machinery_above_checks(lab(hidden, heading, shown)) == []
    assert claim_machinery_above_checks(lab(shown)) is None


@pytest.mark.parametrize("name", PAGE_LABS)
def test_labs_check_themselves_at_the_end(name):
    lab = ROOT / "book" / name / "lab.ipynb"
    found = claim_machinery_above_checks(lab)
    assert found is not None, f"no '{CHECKS_HEADING}' section"
    assert not found, f"move these asserts or attempt logs under '{CHECKS_HEADING}': {found}"
    last = json.loads(lab.read_text())["cells"][-1]
    assert last["cell_type"] == "markdown" and re.search(r"papermill \S+ \S+ -p ", source(last)), (
        "end the lab with what the reader saw and what to try next, with a papermill -p line"
    )
