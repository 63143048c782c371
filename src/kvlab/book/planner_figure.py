"""Chapter 14's Figure 14.2: the planner's predictions against measured serving runs
(`kvlab.planning.measured`), one panel per metric (book/14_capacity_planning)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlab.book import plot
from kvlab.planning.measured import METRICS, NAMES, Row, mape


def planner_vs_measured(rows: Sequence[Row]) -> Any:
    """Predicted against measured, one panel per metric, log axes: each run a marker (colour and shape by
    source, hollow for the calibration runs), the diagonal and a ±25 % band (chapter 14's figure)."""
    fig, panels = plot.figure(3, height=3.2)
    axes = list(panels) if isinstance(panels, Sequence | np.ndarray) else [panels]
    markers = ["o", "s", "^", "D", "v"]
    sources = list(dict.fromkeys(r.source for r in rows))
    for ax, metric in zip(axes, METRICS, strict=True):
        values = [v for r in rows for v in (r.measured[metric], r.predicted[metric])]
        lo, hi = min(values) / 1.5, max(values) * 1.5
        line = np.geomspace(lo, hi, 50)
        ax.fill_between(
            line, line / 1.25, line * 1.25, color="#8d96a3", alpha=0.25, lw=0, label="within ±25 %"
        )
        ax.plot(line, line, color="#333333", lw=0.8, label="predicted = measured")
        for i, source in enumerate(sources):
            colour = plot.PALETTE[i % len(plot.PALETTE)]
            for split, face in (("holdout", colour), ("calibration", "none")):
                part = [r for r in rows if r.source == source and r.split == split]
                if part:
                    ax.scatter(
                        [r.measured[metric] for r in part],
                        [r.predicted[metric] for r in part],
                        s=22,
                        marker=markers[i % len(markers)],
                        facecolors=face,
                        edgecolors=colour,
                        linewidths=0.9,
                        label=source if split == "holdout" else f"{source}, calibration",
                    )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_title(f"{NAMES[metric]} ({mape(rows, metric):.0f} % MAPE)")
        ax.set_xlabel("measured, ms")
    axes[0].set_ylabel("predicted, ms")
    plot.legend_outside(fig, axes, where="bottom", ncol=2)
    return fig
