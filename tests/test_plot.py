"""kvlab.plot: round binary ticks in one unit per axis, and text that stays readable when a figure is shrunk."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from kvlab import plot  # noqa: E402

GiB, MiB = 2**30, 2**20


def tick_labels(top: float) -> list[str]:
    fig, ax = plot.figure()
    ax.plot([0, 1], [0, top])
    ax.set_ylim(0, top)
    plot.bytes_axis(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_visible()]
    matplotlib.pyplot.close(fig)
    return labels


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


def test_text_scales_with_figure_width():
    assert plot.text_scale(7.0) == 1.0  # a one-panel figure is shown about full size
    for width in (12.25, 13.0):  # two or three panels, shrunk to the column
        rendered = plot.STYLE["font.size"] * plot.text_scale(width) * plot.COLUMN_INCHES / width
        assert rendered >= plot.MIN_RENDERED_PT - 1e-9
    plot.figure(ncols=2)
    assert matplotlib.rcParams["xtick.labelsize"] > plot.STYLE["font.size"]
    assert matplotlib.rcParams["legend.fontsize"] > plot.STYLE["font.size"]
    plot.figure()
    assert matplotlib.rcParams["xtick.labelsize"] == plot.STYLE["font.size"]
    matplotlib.pyplot.close("all")


def test_compact_text_is_never_below_the_minimum():
    for ncols in (1, 2, 3):
        fig, _ = plot.figure(ncols=ncols)
        size = plot.compact_text()
        assert size >= plot.MIN_TEXT_PT
        assert size <= matplotlib.rcParams["xtick.labelsize"]  # a step below the ticks, or the floor
        matplotlib.pyplot.close(fig)
    matplotlib.rcParams["xtick.labelsize"] = "small"  # a style that would give 8.3 pt
    assert plot.compact_text() == plot.MIN_TEXT_PT
    plot.use_style()
