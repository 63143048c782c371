"""kvlab.book.plot: column-wide figures, round binary ticks, and the checks a reader's eye makes (legend on the data,
labels on each other, text too small), carried in the PNG for the browser test."""

import io
import json

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402
from PIL import Image  # noqa: E402

from kvlab.book import plot  # noqa: E402

GiB, MiB = 2**30, 2**20


@pytest.fixture(autouse=True)
def close_figures():
    yield
    matplotlib.pyplot.close("all")


def tick_labels(top: float) -> list[str]:
    fig, ax = plot.figure()
    ax.plot([0, 1], [0, top])
    ax.set_ylim(0, top)
    plot.bytes_axis(ax)
    fig.canvas.draw()
    return [t.get_text() for t in ax.get_yticklabels() if t.get_visible()]


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        (100e9, ["0", "20 GiB", "40 GiB", "60 GiB", "80 GiB", "100 GiB"]),
        (25 * MiB, ["0", "5 MiB", "10 MiB", "15 MiB", "20 MiB", "25 MiB"]),
        (1.3 * GiB, ["0", "200 MiB", "400 MiB", "600 MiB", "800 MiB", "1000 MiB", "1200 MiB", "1400 MiB"]),
    ],
)
def test_linear_bytes_axis_ticks_are_round_in_one_unit(top, expected):
    assert tick_labels(top) == expected


@pytest.mark.parametrize("ncols", [1, 2, 3])
def test_every_figure_is_the_column_wide(ncols):
    fig, axes = plot.figure(ncols=ncols)
    assert fig.get_figwidth() == plot.COLUMN_INCHES
    assert fig.get_figheight() == plot.ROW_INCHES
    assert len(np.atleast_1d(axes)) == ncols
    fig, _ = plot.figure(ncols=ncols, nrows=2)
    assert fig.get_size_inches().tolist() == [plot.COLUMN_INCHES, 2 * plot.ROW_INCHES]
    fig, _ = plot.figure(ncols=ncols, height=4.5)
    assert fig.get_size_inches().tolist() == [plot.COLUMN_INCHES, 4.5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ncols": 4}, "1 to 3 panels"),
        ({"nrows": 0}, "at least one row"),
        ({"height": 0}, "positive number of inches"),
        ({"figsize": (12, 4)}, "column's width"),
    ],
)
def test_figure_rejects_what_would_shrink_or_break_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plot.figure(**kwargs)


def test_text_sizes_are_fixed_and_never_under_the_floor():
    plot.figure(ncols=3)
    for key in ("xtick.labelsize", "ytick.labelsize", "legend.fontsize"):
        assert matplotlib.rcParams[key] == plot.TICK_PT
    assert matplotlib.rcParams["axes.labelsize"] == plot.LABEL_PT
    assert matplotlib.rcParams["axes.titlesize"] == plot.TITLE_PT
    assert plot.compact_text() == plot.MIN_TEXT_PT
    assert min(plot.TICK_PT, plot.LABEL_PT, plot.TITLE_PT) >= plot.MIN_TEXT_PT
    # Shown at the 688 CSS px column of a 1280 px window, 1 pt of a column-wide figure is 4/3 CSS px.
    shown = plot.rendered_text_px(plot.MIN_TEXT_PT, plot.DPI, 688, plot.COLUMN_INCHES * plot.DPI)
    assert shown == pytest.approx(plot.MIN_TEXT_PT * 4 / 3, rel=0.01)


def curve_with_legend(loc: str):
    """A rising line with a legend in the corner it passes through, or in the empty one."""
    fig, ax = plot.figure()
    x = np.linspace(0, 1, 50)
    ax.plot(x, x, label="predicted")
    ax.plot(x, x**2, "o", label="measured")
    ax.legend(loc=loc)
    return fig


def test_a_legend_on_a_line_is_reported_and_the_same_legend_outside_is_not():
    on_data = plot.check_figure(curve_with_legend("upper right"))
    assert on_data.legend_overlaps, "the line y = x passes through the upper right corner"
    assert "'predicted'" in on_data.legend_overlaps[0] and not on_data.ok
    assert plot.check_figure(curve_with_legend("upper left")).legend_overlaps == []

    fig, ax = plot.figure()
    ax.plot([0, 1], [0, 1], label="predicted")
    ax.plot([0, 1], [1, 0], label="measured")
    plot.legend_outside(fig)  # the two lines cross every corner of the axes
    check = plot.check_figure(fig)
    assert check.legend_overlaps == [] and check.text_collisions == [] and check.ok


def test_markers_bars_and_scatter_points_under_a_legend_are_reported():
    fig, ax = plot.figure()
    ax.plot([0.95], [0.95], "o", label="one marker")
    ax.set(xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="upper right")
    assert plot.check_figure(fig).legend_overlaps

    fig, ax = plot.figure()
    ax.bar([0, 1, 2], [1, 1, 1], label="bars")
    ax.legend(loc="upper center")
    assert "patch" in plot.check_figure(fig).legend_overlaps[0]
    ax.set_ylim(0, 3)  # room above the bars
    assert plot.check_figure(fig).legend_overlaps == []

    fig, ax = plot.figure()
    ax.scatter([0.05, 0.5], [0.95, 0.5], s=40, label="points")
    ax.set(xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="upper left")
    assert "PathCollection" in plot.check_figure(fig).legend_overlaps[0]
    ax.legend(loc="lower right")
    assert plot.check_figure(fig).legend_overlaps == []


def test_data_outside_the_axes_limits_is_not_under_a_legend():
    # The line leaves the axes through the top right corner, where the figure legend sits: it is clipped there.
    fig, ax = plot.figure()
    ax.plot([0, 10], [0, 10], label="line")
    ax.set(xlim=(0, 1), ylim=(0, 1))
    plot.legend_outside(fig, where="right")
    assert plot.check_figure(fig).legend_overlaps == []


def test_overlapping_annotations_are_reported():
    fig, ax = plot.figure()
    ax.plot([0, 1], [0, 1])
    ax.annotate("2,198 seq", (0.5, 0.5), fontsize=plot.MIN_TEXT_PT)
    ax.annotate("1,752 seq", (0.52, 0.51), fontsize=plot.MIN_TEXT_PT)
    collisions = plot.check_figure(fig).text_collisions
    assert collisions == ["text '2,198 seq' overlaps text '1,752 seq'"]

    ax.texts[1].set_position((0.5, 0.2))  # far apart
    assert plot.check_figure(fig).text_collisions == []


def test_colliding_tick_labels_are_reported_and_touching_neighbours_are_not():
    fig, ax = plot.figure()
    ax.plot(range(10))
    assert plot.check_figure(fig).text_collisions == []  # matplotlib's own spacing
    ax.set_xticks(np.arange(0, 10, 0.25))  # 37 labels in 7 in
    assert any("x tick label" in c for c in plot.check_figure(fig).text_collisions)


def test_rotated_labels_are_tested_as_rotated_boxes():
    # Long labels at 45 degrees: their bounding boxes overlap, the glyphs' rotated boxes do not.
    fig, ax = plot.figure()
    names = [f"model-{i}-instruct" for i in range(12)]
    ax.bar(names, range(12))
    ax.tick_params(axis="x", labelrotation=45)
    fig.draw_without_rendering()
    boxes = [t.get_window_extent() for t in ax.get_xticklabels()]
    assert boxes[0].overlaps(boxes[1])
    assert plot.check_figure(fig).text_collisions == []


def test_a_legend_over_a_tick_label_is_a_collision():
    fig, ax = plot.figure()
    for k in range(3):
        ax.plot([0, 1], [k, k + 1], label=f"line {k}")
    ax.legend(loc="center left", bbox_to_anchor=(-0.15, 0.5))  # over the y tick labels
    assert any("covers y tick label" in c for c in plot.check_figure(fig).text_collisions)


def test_small_text_lowers_min_text_pt_below_the_floor():
    fig, ax = plot.figure()
    ax.plot([0, 1], [0, 1])
    assert plot.check_figure(fig).min_text_pt == plot.MIN_TEXT_PT + 0.5  # tick labels
    ax.annotate("note", (0.2, 0.8), fontsize=7)
    check = plot.check_figure(fig)
    assert check.min_text_pt == 7 and not check.ok
    ax.texts[0].set_visible(False)  # what is not drawn does not count
    assert plot.check_figure(fig).min_text_pt == plot.MIN_TEXT_PT + 0.5


def test_legend_outside_takes_each_label_once_in_columns_that_fit():
    fig, (left, right) = plot.figure(ncols=2)
    for ax in (left, right):
        for k in range(3):
            ax.plot([0, 1], [k, k + 1], label=f"series {k}")
    legend = plot.legend_outside(fig)
    assert [t.get_text() for t in legend.get_texts()] == ["series 0", "series 1", "series 2"]
    assert legend._ncols == 3  # three short labels fit one row
    fig.draw_without_rendering()
    top_of_axes = max(ax.get_window_extent().y1 for ax in fig.axes)
    assert legend.get_window_extent().y0 >= top_of_axes  # above the panels

    fig, ax = plot.figure()
    for k in range(8):
        ax.plot([0, 1], [k, k], label=f"a long series name number {k}")
    assert 1 < plot.legend_outside(fig)._ncols < 8
    with pytest.raises(ValueError, match="no artist"):
        plot.legend_outside(plot.figure()[0])
    with pytest.raises(ValueError, match="where='left'"):
        plot.legend_outside(fig, where="left")


def test_segments_meet_a_box_only_where_they_cross_it():
    box = Bbox.from_extents(0, 0, 10, 10)
    assert plot.segments_meet_box(np.array([[-5, 5], [15, 5]]), box)  # straight through
    assert plot.segments_meet_box(np.array([[2, 2], [3, 3]]), box)  # wholly inside
    assert not plot.segments_meet_box(np.array([[-5, 12], [20, 30]]), box)  # above
    # Diagonal past the corner: the segment's bounding box overlaps the box, the segment does not.
    assert not plot.segments_meet_box(np.array([[8, 14], [14, 8]]), box)
    assert not plot.segments_meet_box(np.array([[-5, 5], [np.nan, np.nan], [15, 5]]), box)  # NaN breaks it
    assert plot.points_meet_box(np.array([[12, 5]]), 3, box)
    assert not plot.points_meet_box(np.array([[12, 5]]), 1, box)


def test_png_carries_the_check_in_its_text_chunks():
    fig = curve_with_legend("upper right")
    fig.axes[0].annotate("small", (0.1, 0.9), fontsize=7)
    data = plot.png_bytes(fig)
    with Image.open(io.BytesIO(data)) as image:
        assert image.size[0] == int(plot.COLUMN_INCHES * plot.DPI)  # its own size: not cropped
        assert json.loads(image.text[plot.CHUNK_LEGEND_OVERLAPS])
    found = plot.read_png(data)
    assert found is not None
    assert found.min_text_pt == 7
    assert found.dpi == pytest.approx(plot.DPI, abs=0.05)  # pHYs stores whole pixels per metre
    assert found.legend_overlaps == plot.check_figure(fig).legend_overlaps
    assert found.text_px(688, image.size[0]) == pytest.approx(7 * 4 / 3, rel=0.01)

    plain = io.BytesIO()
    fig.savefig(plain, format="png")  # drawn outside kvlab's renderer: no chunks
    assert plot.read_png(plain.getvalue()) is None
    with pytest.raises(ValueError, match="need positive sizes"):
        plot.rendered_text_px(9, 150, 688, 0)


def test_the_style_never_crops_a_saved_figure():
    plot.use_style()
    assert matplotlib.rcParams["savefig.bbox"] is None  # "standard": the whole figure, never cropped


def test_inside_ipython_figures_display_as_kvlab_pngs():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        fig = curve_with_legend("upper right")  # plot.figure registers kvlab's renderer
        data, _ = shell.display_formatter.format(fig)
        found = plot.read_png(data["image/png"])
        assert found is not None and found.legend_overlaps == plot.check_figure(fig).legend_overlaps
    finally:
        InteractiveShell.clear_instance()


def test_check_figure_reports_text_and_legends_cut_at_the_figure_edge():
    fig, ax = plot.figure()
    ax.plot([0, 1], [0, 1], label="a series")
    assert not any("runs off" in c for c in plot.check_figure(fig).text_collisions)
    ax.set_title("a title far too long for the column " * 4)
    ax.legend(loc="upper left", bbox_to_anchor=(-0.4, 1.0))
    found = [c for c in plot.check_figure(fig).text_collisions if "runs off" in c]
    assert any("title" in c for c in found) and any("legend" in c for c in found), found
    matplotlib.pyplot.close(fig)


def test_legend_outside_picks_columns_that_fit_as_matplotlib_fills_them():
    # Six entries in five columns are 2+1+1+1+1, not three columns of two: the width must count five.
    names = ["Llama-3.1-8B", "Qwen3-8B", "gemma-3-27b-it", "Mistral-7B-v0.3", "DeepSeek-V3", "Llama-3.1-70B"]
    fig, ax = plot.figure()
    for name in names:
        ax.plot([0, 1], [0, 1], label=name)
    plot.legend_outside(fig)
    assert not plot.check_figure(fig).text_collisions
    matplotlib.pyplot.close(fig)


def test_log_axis_ticks_are_plain_round_numbers():
    fig, ax = plot.figure()
    ax.plot([0.3, 60], [0.3, 60])
    ax.set(xscale="log", yscale="log")
    plot.log_axis(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_visible() and t.get_text()]
    lo, hi = ax.get_ylim()
    shown = [v for v in ax.get_yticks() if lo <= v <= hi]
    assert {f"{v:g}" for v in shown} <= {"0.5", "1", "2", "5", "10", "20", "50"}
    assert "0.5" in labels and "50" in labels and not any("10^" in t or "×" in t for t in labels)
    linear = plot.figure()[1]
    with pytest.raises(ValueError, match="not on a log scale"):
        plot.log_axis(linear)
    matplotlib.pyplot.close("all")
