"""One figure style for the whole book: predicted lines, measured markers, bytes on binary axes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib as mpl
import matplotlib.pyplot as plt
from cycler import cycler
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

from kvlab.units import format_bytes

PREDICTED = "#1f4e79"  # dark blue line: what kvlab computes
MEASURED = "#d1495b"  # red markers: what the lab measured
PALETTE = ["#1f4e79", "#d1495b", "#edae49", "#00798c", "#66a182", "#8d96a3", "#30638e", "#a05195"]

# rcParams keys are checked by matplotlib at run time; its stubs type them as literals, which dicts can't carry.
STYLE: dict[Any, Any] = {
    "figure.figsize": (7.0, 4.2),
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": cycler(color=PALETTE),
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "legend.frameon": False,
    "font.size": 10,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
}


# The book's text column is about 688 CSS px (7.17 in) wide in a 1280 px window; wider figures are shrunk to it.
COLUMN_INCHES = 7.17
MIN_RENDERED_PT = 9.5  # smallest tick / legend text a reader sees in the column
# Tick labels and legends scale with the figure's width; titles and axis labels keep their size, so long
# titles of side-by-side panels do not run into each other.
_TEXT_KEYS: tuple[Any, ...] = ("xtick.labelsize", "ytick.labelsize", "legend.fontsize")


def text_scale(width_inches: float) -> float:
    """Factor on the style's font sizes so a figure this wide, shrunk to the column, keeps readable text."""
    shrink = max(1.0, width_inches / COLUMN_INCHES)
    return max(1.0, MIN_RENDERED_PT * shrink / STYLE["font.size"])


MIN_TEXT_PT = (
    9.0  # no text in a figure is set smaller than this (tests/test_book_conventions.py checks the labs)
)


def compact_text() -> float:
    """Font size, in points, for dense text: a legend of many entries, labels inside heatmap cells, annotations.

    One step below the current figure's tick labels (which `figure` scales with the figure's width), never under
    MIN_TEXT_PT; use it instead of a fixed `fontsize=8`, which the column would shrink further."""
    from matplotlib.font_manager import FontProperties

    ticks = FontProperties(size=mpl.rcParams["xtick.labelsize"]).get_size_in_points()
    return max(MIN_TEXT_PT, 0.9 * ticks)


def use_style() -> None:
    """Apply the house style to every later figure (call once per notebook)."""
    mpl.rcParams.update(STYLE)


def figure(ncols: int = 1, nrows: int = 1, **kwargs) -> tuple[Figure, Axes | Sequence[Axes]]:
    use_style()
    width, height = STYLE["figure.figsize"]
    kwargs.setdefault("figsize", (width * (1 + 0.75 * (ncols - 1)), height * (1 + 0.8 * (nrows - 1))))
    kwargs.setdefault("layout", "constrained")
    # Tick labels and legends created for this figure scale with its width.
    scale = text_scale(kwargs["figsize"][0])
    mpl.rcParams.update({key: STYLE[key] * scale for key in _TEXT_KEYS})
    return plt.subplots(nrows, ncols, **kwargs)


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


class BinaryLocator(MaxNLocator):
    """Linear-axis ticks on round values of one binary unit: 0, 20, 40 GiB rather than 18.6, 37.3 GiB.

    The whole axis is labelled in that one unit (`label`), e.g. 250 MiB ... 1250 MiB, never MiB and GiB mixed.
    """

    def __init__(self):
        super().__init__(nbins="auto", steps=[1, 2, 2.5, 5, 10])
        self.exponent = 0

    def tick_values(self, vmin: float, vmax: float):
        top = max(abs(vmin), abs(vmax))
        self.exponent = 0
        while self.exponent < len(_BINARY_UNITS) - 1 and top >= 2 * 1024 ** (self.exponent + 1):
            self.exponent += 1  # the largest unit with at least 2 of it on the axis
        unit = 1024**self.exponent
        return super().tick_values(vmin / unit, vmax / unit) * unit

    def label(self, value: float) -> str:
        return f"{value / 1024**self.exponent:g} {_BINARY_UNITS[self.exponent]}" if value else "0"


def bytes_axis(ax: Axes, axis: str = "y") -> None:
    """Label ticks of `axis` ("x" or "y") in KiB/MiB/GiB."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    if target.get_scale() == "log":  # powers of 4 land on round binary sizes: 1 KiB, 4 KiB, 16 KiB, ...
        target.set_major_locator(LogLocator(base=4, numticks=12))
        target.set_minor_locator(NullLocator())
        target.set_major_formatter(
            FuncFormatter(lambda value, _pos: format_bytes(value, 3) if value >= 0 else "")
        )
    else:
        locator = BinaryLocator()
        target.set_major_locator(locator)
        target.set_major_formatter(
            FuncFormatter(lambda value, _pos: locator.label(value) if value >= 0 else "")
        )


def step_series(ax: Axes, stats: Sequence[Any], field: str, *, color: str, label: str) -> None:
    """One engine run's `field` of `StepStats`, step by step, as a thin line."""
    ax.plot([s.step for s in stats], [getattr(s, field) for s in stats], color=color, lw=1.2, label=label)


def predicted_vs_measured(
    ax: Axes,
    x: Sequence[float],
    predicted: Sequence[float],
    measured: Sequence[float],
    *,
    label: str = "",
    color: str | None = None,
) -> None:
    """Prediction as a line, measurement as hollow markers over it, sharing one colour per series."""
    suffix = f" ({label})" if label else ""
    line = ax.plot(x, predicted, "-", color=color or PREDICTED, lw=1.8, label=f"predicted{suffix}")[0]
    ax.plot(
        x,
        measured,
        "o",
        mfc="none",
        mec=MEASURED if color is None else line.get_color(),
        mew=1.6,
        ms=7,
        label=f"measured{suffix}",
    )
