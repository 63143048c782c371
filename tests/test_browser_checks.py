"""tools/browser_book.py's figure and overflow rules, on PNGs drawn here and on what a page would report: the
parts of the browser test that need no browser."""

import matplotlib

matplotlib.use("Agg")

import browser_book  # noqa: E402
import pytest  # noqa: E402

from kvlab.book import plot  # noqa: E402


@pytest.fixture
def figure_png(tmp_path):
    """A column-wide kvlab figure saved as the book saves it; `annotate` adds a text of that size."""

    def draw(name: str, annotate: float | None = None, legend: str = "upper left") -> str:
        fig, ax = plot.figure()
        ax.plot([0, 1], [0, 1], label="line")
        ax.legend(loc=legend)
        if annotate:
            ax.annotate("note", (0.7, 0.2), fontsize=annotate)
        path = tmp_path / name
        path.write_bytes(plot.png_bytes(fig))
        matplotlib.pyplot.close(fig)
        return path.as_uri()

    return draw


NATURAL = int(plot.COLUMN_INCHES * plot.DPI)  # 1075 px


def test_a_column_figure_reads_at_the_laptop_column_and_at_the_phone_minimum(figure_png):
    src = figure_png("ok.png")
    assert browser_book.figure_problems({"src": src, "natural": NATURAL, "shown": 688}, 1280) == []
    # Its smallest text is the 9.5 pt tick labels. On a phone the CSS keeps figures 540 px wide: 9.9 CSS px.
    assert browser_book.figure_problems({"src": src, "natural": NATURAL, "shown": 540}, 412) == []
    # Shrunk to the phone's 380 px column they would be 7.0 px.
    (problem,) = browser_book.figure_problems({"src": src, "natural": NATURAL, "shown": 380}, 412)
    assert "smallest text 7.0 CSS px at a 412 px window, under 9 (9.5 pt at 150 dpi" in problem


def test_small_text_fails_at_the_laptop_window(figure_png):
    src = figure_png("small.png", annotate=7)  # 7 pt at 688 of 1075 px: 9.3 CSS px
    (problem,) = browser_book.figure_problems({"src": src, "natural": NATURAL, "shown": 688}, 1280)
    assert "smallest text 9.3 CSS px at a 1280 px window, under 11" in problem


def test_overlaps_recorded_in_the_png_fail_once(figure_png):
    src = figure_png("on_data.png", legend="upper right")  # the line y = x runs through that corner
    figure = {"src": src, "natural": NATURAL, "shown": 688}
    problems = browser_book.figure_problems(figure, 1280)
    assert problems and all("legend on the data: legend ('line') covers line 'line'" in p for p in problems)
    assert browser_book.figure_problems({**figure, "shown": 540}, 412) == []  # reported at the laptop width


def test_a_figure_not_drawn_by_kvlab_plot_is_a_problem(tmp_path):
    fig, ax = matplotlib.pyplot.subplots()
    ax.plot([0, 1])
    path = tmp_path / "plain.png"
    fig.savefig(path)
    matplotlib.pyplot.close(fig)
    figure = {"src": path.as_uri(), "natural": 640, "shown": 640}
    (problem,) = browser_book.figure_problems(figure, 1280)
    assert "no kvlab chunks" in problem
    path.write_bytes(b"GIF89a not a png")
    assert browser_book.figure_problems(figure, 1280) != []


def test_min_text_px_per_window():
    assert browser_book.min_text_px(1280) == 11
    assert browser_book.min_text_px(412) == 9


def test_overflow_lines_keep_what_scrolls_more_than_a_pixel():
    overflows = [
        {"kind": "code cell", "over": 107, "text": "x = 1  # a long line"},
        {"kind": "table", "over": 1, "text": "model | bytes"},  # rounding of a fitted table
        {"kind": "table", "over": 32, "text": "model | bytes"},
    ]
    assert browser_book.overflow_lines(overflows, 1280) == [
        "code cell 107 px wider than its box at a 1280 px window: 'x = 1  # a long line'",
        "table 32 px wider than its box at a 1280 px window: 'model | bytes'",
    ]


def test_what_may_scroll_is_noted_apart_from_what_must_fit():
    overflows = [
        {"kind": "code cell", "over": 40, "text": "x", "must_fit": True},
        {"kind": "printed or command block", "over": 300, "text": "y", "must_fit": False},
        {"kind": "table", "over": 20, "text": "z", "must_fit": False},
    ]
    assert [line.split()[0] for line in browser_book.overflow_lines(overflows, 1280)] == ["code"]
    assert len(browser_book.overflow_lines(overflows, 1280, must_fit=False)) == 2


def test_a_figure_or_table_cut_at_the_column_needs_a_line_saying_it_scrolls():
    cut = [
        {"kind": "figure", "what": "Figure 5.1 a.png", "hidden": 160, "scrolls": True, "hinted": False},
        {"kind": "figure", "what": "Figure 5.2 b.png", "hidden": 160, "scrolls": True, "hinted": True},
        {"kind": "table", "what": "The log says", "hidden": 145, "scrolls": False, "hinted": False},
        {"kind": "table", "what": "Term", "hidden": 1, "scrolls": True, "hinted": False},  # rounding
        {"kind": "figure", "what": "Diagram 5 m.svg", "hidden": -16, "scrolls": False, "hinted": False},
    ]
    assert browser_book.cut_lines(cut, 412) == [
        "figure 'Figure 5.1 a.png': 160 px of it cut off at the right at a 412 px window, and no line above it "
        "says it scrolls sideways",
        "table 'The log says': 145 px of it cut off at the right at a 412 px window, with nothing to scroll it",
    ]


def test_each_pass_owns_its_section_of_the_notes(tmp_path, monkeypatch):
    monkeypatch.setattr(browser_book, "SCREENSHOTS", tmp_path)
    browser_book.write_notes("At 1280", ["a"])
    browser_book.write_notes("At 412", ["b"])
    browser_book.write_notes("At 1280", ["c"])
    assert (tmp_path / "readability.txt").read_text() == "## At 1280\nc\n## At 412\nb\n"
