"""One figure style for the whole book: column-wide figures, fixed text sizes, nothing on the data.

Every figure is the book's column wide (`COLUMN_INCHES`), so its text is shown at the size it is set in:
1 pt of figure text is about 1.33 CSS px in a 1280 px window. `check_figure` tests a drawn figure for the two
faults a reader sees (a legend on the data, labels on each other) and for text under `MIN_TEXT_PT`. Inside
IPython the figure's PNG is rendered by `png_bytes`, which writes that check into the PNG's text chunks;
tools/browser_book.py reads them back (`read_png`) and measures the text as the page shows it.
"""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
from cycler import cycler
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.axis import Axis, XAxis
from matplotlib.cbook import STEP_LOOKUP_MAP
from matplotlib.collections import Collection, LineCollection, PathCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.table import Table
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator
from matplotlib.transforms import Bbox, BboxBase

from kvlab.units import format_bytes

PREDICTED = "#1f4e79"  # dark blue line: what kvlab computes
MEASURED = "#d1495b"  # red markers: what the lab measured
PALETTE = ["#1f4e79", "#d1495b", "#edae49", "#00798c", "#66a182", "#8d96a3", "#30638e", "#a05195"]

# The book's text column is about 688 CSS px (7.17 in) wide in a 1280 px window. Every figure is that wide,
# so its text is never shrunk: 9 pt at 150 dpi is 18.75 image px, shown at 688/1075 of that, 12 CSS px.
COLUMN_INCHES = 7.17
ROW_INCHES = 3.0  # height of one row of panels
MAX_COLUMNS = 3  # more panels side by side leave each too narrow for its tick labels: use nrows
DPI = 150  # the PNG the book shows
TICK_PT = 9.5  # tick labels and legends
LABEL_PT = 10.0  # axis labels
TITLE_PT = 10.5  # panel and figure titles
# No text in a figure is smaller (tests/test_book_conventions.py checks the labs' font sizes, check_figure
# the drawn figure, tools/browser_book.py the page).
MIN_TEXT_PT = 9.0

# rcParams keys are checked by matplotlib at run time; its stubs type them as literals, which dicts can't carry.
STYLE: dict[Any, Any] = {
    "figure.figsize": (COLUMN_INCHES, ROW_INCHES),
    "figure.dpi": 100,
    "savefig.dpi": DPI,
    # The figure is saved at its own size: a cropped PNG would be shown wider than the figure was drawn.
    "savefig.bbox": "standard",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": cycler(color=PALETTE),
    "axes.titlesize": TITLE_PT,
    "axes.labelsize": LABEL_PT,
    "figure.titlesize": TITLE_PT,
    "figure.labelsize": LABEL_PT,
    "legend.frameon": False,
    "font.size": TICK_PT,
    "xtick.labelsize": TICK_PT,
    "ytick.labelsize": TICK_PT,
    "legend.fontsize": TICK_PT,
    "legend.title_fontsize": TICK_PT,
}

# PNG text chunks of a figure drawn by kvlab.book.plot (png_bytes writes them, read_png reads them).
CHUNK_MIN_TEXT_PT = "kvlab:min_text_pt"
CHUNK_LEGEND_OVERLAPS = "kvlab:legend_overlaps"  # a JSON list of strings
CHUNK_TEXT_COLLISIONS = "kvlab:text_collisions"  # a JSON list of strings


def compact_text() -> float:
    """Font size, in points, for dense text: a legend of many entries, labels inside heatmap cells, annotations.

    Always MIN_TEXT_PT: figures are never shrunk, so the floor is what the reader sees."""
    return MIN_TEXT_PT


def use_style() -> None:
    """Apply the house style to every later figure, and inside IPython render figures with `png_bytes`.

    `figure` calls it, so a lab need not. Registering again on every call keeps kvlab's renderer ahead of
    matplotlib-inline's, which re-registers its own when the inline backend is configured."""
    mpl.rcParams.update(STYLE)
    _render_pngs_with_kvlab()


def _render_pngs_with_kvlab() -> None:
    """Make `png_bytes` IPython's PNG formatter for figures (inside IPython; elsewhere do nothing)."""
    # IPython is imported only where a kernel or shell runs; a plain script never renders PNGs this way.
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        shell.display_formatter.formatters["image/png"].for_type(Figure, png_bytes)


def figure(
    ncols: int = 1, nrows: int = 1, *, height: float | None = None, **kwargs
) -> tuple[Figure, Axes | Sequence[Axes]]:
    """A figure exactly the column wide (`COLUMN_INCHES`) with `nrows` x `ncols` axes, constrained layout.

    Height is `ROW_INCHES` a row unless `height` (total inches) is given. Other keyword arguments go to
    `plt.subplots` (sharex, width_ratios, ...)."""
    if not 1 <= ncols <= MAX_COLUMNS:
        raise ValueError(f"ncols={ncols}: a figure has 1 to {MAX_COLUMNS} panels side by side; use nrows")
    if nrows < 1:
        raise ValueError(f"nrows={nrows}: a figure has at least one row")
    if height is not None and not height > 0:
        raise ValueError(f"height={height}: a figure's height is a positive number of inches")
    if "figsize" in kwargs:
        raise ValueError("figsize: every figure is the column's width; give height= (inches) instead")
    use_style()
    kwargs.setdefault("layout", "constrained")
    size = (COLUMN_INCHES, height if height is not None else ROW_INCHES * nrows)
    made = plt.subplots(nrows, ncols, figsize=size, **kwargs)
    # The notebook's first figure loads matplotlib-inline, which then registers its own PNG formatter.
    _render_pngs_with_kvlab()
    return made


# Constrained layout places a figure legend with an "outside ..." location beside the axes, never over them.
_OUTSIDE: dict[str, Any] = {
    "top": "outside upper center",
    "right": "outside right upper",
    "bottom": "outside lower center",
}


def legend_outside(
    fig: Figure,
    axes: Axes | Sequence[Axes] | None = None,
    *,
    where: str = "top",
    ncol: int | None = None,
    title: str | None = None,
) -> Legend:
    """One figure legend outside every axes, from the labelled artists of `axes` (default: all), each label once.

    "top" (above the panels) and "bottom" lay the entries out in as many columns as fit the figure's width;
    "right" puts them in one column right of the panels. Needs the constrained layout `figure` sets, which does
    not keep such a legend off `fig.suptitle` ("top") or `fig.supxlabel` ("bottom"): check_figure reports the
    collision; put the title in the caption instead."""
    if where not in _OUTSIDE:
        raise ValueError(f"where={where!r}: a legend goes {', '.join(map(repr, _OUTSIDE))}")
    if ncol is not None and ncol < 1:
        raise ValueError(f"ncol={ncol}: a legend has at least one column")
    chosen = fig.axes if axes is None else [axes] if isinstance(axes, Axes) else list(axes)
    entries: dict[str, Artist] = {}
    for ax in chosen:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if not entries:
        raise ValueError("legend_outside: no artist in these axes has a label (pass label= when plotting)")
    labels = list(entries)
    if ncol is None:
        ncol = 1 if where == "right" else _columns_that_fit(fig, labels)
    return fig.legend(list(entries.values()), labels, loc=_OUTSIDE[where], ncols=ncol, title=title)


def _columns_that_fit(fig: Figure, labels: list[str]) -> int:
    """The most legend columns whose entries (handle, gap, text) fit side by side in the figure's width."""
    size = mpl.rcParams["legend.fontsize"]
    font = FontProperties(size=size)
    widths = [_text_box(fig, label, font).width for label in labels]
    em = size * fig.dpi / 72
    rc = mpl.rcParams
    handle = (rc["legend.handlelength"] + rc["legend.handletextpad"]) * em
    spacing = rc["legend.columnspacing"] * em
    available = fig.get_figwidth() * fig.dpi - 2 * rc["legend.borderpad"] * em
    for ncol in range(len(labels), 1, -1):
        # matplotlib fills `ncol` columns top to bottom in order, the first `extra` of them one entry longer
        rows, extra = divmod(len(labels), ncol)
        sizes = [rows + 1] * extra + [rows] * (ncol - extra)
        starts = [sum(sizes[:k]) for k in range(ncol)]
        columns = [widths[a : a + n] for a, n in zip(starts, sizes, strict=True) if n]
        total = sum(handle + max(c) for c in columns) + spacing * (len(columns) - 1)
        if total <= available:
            return ncol
    return 1


@dataclass(frozen=True)
class FigureCheck:
    """What a reader would find wrong in a drawn figure.

    min_text_pt: the smallest visible, non-empty text, in points (inf when the figure has none).
    legend_overlaps: each legend box that meets a line, marker, bar, patch, scatter point or image.
    text_collisions: each pair of visible texts (tick labels included) whose boxes overlap, and each text that a
    legend's box covers."""

    min_text_pt: float
    legend_overlaps: list[str]
    text_collisions: list[str]

    @property
    def ok(self) -> bool:
        return not self.legend_overlaps and not self.text_collisions and self.min_text_pt >= MIN_TEXT_PT


# Two boxes overlap when they share more than this many display pixels each way: a shared edge is touching.
_TOUCH_PX = 0.5


def check_figure(fig: Figure) -> FigureCheck:
    """Draw `fig` once (no pixels) and test it: legends against the data, texts against each other."""
    fig.draw_without_rendering()
    texts = list(_drawn_texts(fig))
    legends = [legend for legend in fig.findobj(Legend) if _shown(legend)]
    legend_texts = {id(t) for legend in legends for t in legend.findobj(Text)}
    overlaps = []
    collisions = _text_collisions(texts)
    for legend in legends:
        box = legend.get_window_extent()
        name = _legend_name(legend)
        for i, ax in enumerate(fig.axes):
            for what in _data_under(ax, box, fig.dpi):
                overlaps.append(f"legend {name} covers {what} in axes {i}{_axes_title(ax)}")
        for text, role in texts:
            if id(text) not in legend_texts and _overlap(box, _extent(text)):
                collisions.append(f"legend {name} covers {role} {text.get_text()!r}")
    # A text or legend cut at the figure's edge is as unreadable as one under another.
    page = fig.bbox
    for text, role in texts:
        if _beyond(_extent(text), page):
            collisions.append(f"{role} {text.get_text()!r} runs off the figure")
    for legend in legends:
        if _beyond(legend.get_window_extent(), page):
            collisions.append(f"legend {_legend_name(legend)} runs off the figure")
    return FigureCheck(
        min_text_pt=min((float(t.get_fontsize()) for t, _ in texts), default=math.inf),
        legend_overlaps=overlaps,
        text_collisions=collisions,
    )


def _beyond(box: BboxBase, page: BboxBase) -> bool:
    """Whether `box` reaches more than _TOUCH_PX past any edge of `page`."""
    return (
        box.x0 < page.x0 - _TOUCH_PX
        or box.y0 < page.y0 - _TOUCH_PX
        or box.x1 > page.x1 + _TOUCH_PX
        or box.y1 > page.y1 + _TOUCH_PX
    )


def _shown(artist: Artist) -> bool:
    """Visible, and so are the artists it belongs to (an axes turned off hides its axis)."""
    return artist.get_visible() and all(a.get_visible() for a in _parents(artist))


def _parents(artist: Artist) -> Iterator[Artist]:
    axes = getattr(artist, "axes", None)
    if axes is not None and axes is not artist:
        yield axes


def _drawn_texts(fig: Figure) -> Iterator[tuple[Text, str]]:
    """Every text the last draw put on the figure, non-empty, with what it is ("x tick label", "title", ...)."""

    def walk(artist: Artist, role: str) -> Iterator[tuple[Text, str]]:
        if not artist.get_visible():
            return
        if isinstance(artist, Text):
            if artist.get_text().strip() and artist.get_alpha() != 0 and _inside_clip(artist):
                yield artist, role
            return
        if isinstance(artist, Axis):
            name = "x" if isinstance(artist, XAxis) else "y"
            # The ticks the axis draws: the ones inside its view limits (matplotlib's own Axis.draw uses this).
            for tick in artist._update_ticks():  # type: ignore[attr-defined]
                if tick.get_visible():
                    yield from walk(tick.label1, f"{name} tick label")
                    yield from walk(tick.label2, f"{name} tick label")
            yield from walk(artist.label, f"{name} axis label")
            yield from walk(artist.offsetText, f"{name} axis offset")
            return
        if isinstance(artist, Table):
            # a table's cells are patches that hold their text outside the artist tree
            for cell in artist.get_celld().values():
                if cell.get_visible():
                    yield from walk(cell.get_text(), "table cell")
            return
        children = artist.get_children()
        if isinstance(artist, Axes) and not artist.axison:
            children = [c for c in children if not isinstance(c, Axis)]
        for child in children:
            yield from walk(child, _role(artist, child, role))

    yield from walk(fig, "text")


def _role(parent: Artist, child: Artist, role: str) -> str:
    if isinstance(parent, Legend):
        return "legend text"
    if isinstance(parent, Axes) and child is parent.title:
        return "title"
    if isinstance(parent, Figure) and child is getattr(parent, "_suptitle", None):
        return "figure title"
    return role


def _inside_clip(text: Text) -> bool:
    """False for a clipped text that lies wholly outside its clip box, which the draw leaves out."""
    clip = text.get_clip_box() if text.get_clip_on() else None
    return clip is None or _overlap(clip, _extent(text), touch=0.0)


def _extent(text: Text) -> Bbox:
    return text.get_window_extent()


def _overlap(a: Bbox, b: Bbox, touch: float = _TOUCH_PX) -> bool:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width > touch and height > touch


def _text_collisions(texts: list[tuple[Text, str]]) -> list[str]:
    """Pairs of texts whose boxes overlap; a rotated text is tested as the rotated box of its glyphs."""
    if len(texts) < 2:
        return []
    boxes = np.array([_extent(t).extents for t, _ in texts])  # x0, y0, x1, y1
    x0, y0, x1, y1 = (boxes[:, k] for k in range(4))
    width = np.minimum.outer(x1, x1) - np.maximum.outer(x0, x0)
    height = np.minimum.outer(y1, y1) - np.maximum.outer(y0, y0)
    candidates = np.argwhere(np.triu((width > _TOUCH_PX) & (height > _TOUCH_PX), k=1))
    found = []
    for i, j in candidates:
        (a, role_a), (b, role_b) = texts[i], texts[j]
        if _rotated(a) or _rotated(b):
            if not _polygons_overlap(_corners(a), _corners(b)):
                continue
        found.append(f"{role_a} {a.get_text()!r} overlaps {role_b} {b.get_text()!r}")
    return found


def _text_box(fig: Figure | None, text: str, font: FontProperties) -> Bbox:
    """The unrotated box, in display px, that `text` in `font` takes in `fig` (laid out, not drawn)."""
    probe = Text(0, 0, text, fontproperties=font)
    if fig is not None:
        probe.set_figure(fig)
    return probe.get_window_extent()


def _rotated(text: Text) -> bool:
    return text.get_rotation() % 90 != 0


def _corners(text: Text) -> np.ndarray:
    """The four corners, in display pixels, of the text's own (rotated) box."""
    box = _extent(text)
    if not _rotated(text):
        return np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x1, box.y1], [box.x0, box.y1]])
    # The same text unrotated gives the box's sides; the rotated box shares its centre with its bounding box.
    size = _text_box(text.get_figure(root=True), text.get_text(), text.get_fontproperties())
    angle = math.radians(text.get_rotation())
    along = np.array([math.cos(angle), math.sin(angle)]) * size.width / 2
    across = np.array([-math.sin(angle), math.cos(angle)]) * size.height / 2
    centre = np.array([(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2])
    return np.array(
        [centre - along - across, centre + along - across, centre + along + across, centre - along + across]
    )


def _polygons_overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Separating-axis test of two convex quadrilaterals: they overlap unless some edge's normal separates them."""
    for poly in (a, b):
        for k in range(4):
            edge = poly[(k + 1) % 4] - poly[k]
            normal = np.array([-edge[1], edge[0]])
            length = float(np.hypot(*normal))
            if length == 0:
                continue
            pa, pb = a @ normal / length, b @ normal / length
            if min(pa.max(), pb.max()) - max(pa.min(), pb.min()) <= _TOUCH_PX:
                return False
    return True


def _legend_name(legend: Legend) -> str:
    labels = [t.get_text() for t in legend.get_texts()][:3]
    more = ", ..." if len(legend.get_texts()) > 3 else ""
    return "(" + ", ".join(repr(label) for label in labels) + more + ")"


def _axes_title(ax: Axes) -> str:
    title = ax.get_title() or ax.get_title("left") or ax.get_title("right")
    return f" ({title!r})" if title else ""


def _artist_name(kind: str, artist: Artist) -> str:
    label = artist.get_label()
    return f"{kind} {label!r}" if label and not str(label).startswith("_") else kind


def _data_under(ax: Axes, box: Bbox, dpi: float) -> Iterator[str]:
    """What of `ax`'s data (lines, markers, patches, collections, images) the box `box` meets."""
    if not _shown(ax):
        return
    for line in ax.lines:
        if line.get_visible() and _line_meets(line, _clipped(line, box), dpi):
            yield _artist_name("line", line)
    for patch in ax.patches:
        if patch.get_visible() and _patch_meets(patch, _clipped(patch, box)):
            yield _artist_name("patch", patch)
    for collection in ax.collections:
        if collection.get_visible() and _collection_meets(collection, _clipped(collection, box), dpi):
            yield _artist_name(type(collection).__name__, collection)
    for image in ax.images:
        if image.get_visible() and _overlap(_clipped(image, box), image.get_window_extent()):
            yield _artist_name("image", image)


def _clipped(artist: Artist, box: Bbox) -> Bbox:
    """The part of `box` where `artist` can show: inside its clip box (the axes) when it is clipped."""
    clip = artist.get_clip_box() if artist.get_clip_on() else None
    if clip is None:
        return box
    return Bbox.from_extents(
        max(box.x0, clip.x0), max(box.y0, clip.y0), min(box.x1, clip.x1), min(box.y1, clip.y1)
    )


def _empty(box: Bbox) -> bool:
    return box.x1 <= box.x0 or box.y1 <= box.y0


def _grown(box: Bbox, by: float) -> Bbox:
    return Bbox.from_extents(box.x0 - by, box.y0 - by, box.x1 + by, box.y1 + by)


def segments_meet_box(points: np.ndarray, box: Bbox) -> bool:
    """Whether the polyline through `points` (N x 2, display px; NaN breaks it) meets the rectangle `box`.

    A segment misses the box only when an axis separates them: x, y (the box's sides) or the segment's
    normal (all four corners strictly on one side of the segment's line)."""
    if len(points) < 2 or _empty(box):
        return False
    start, end = points[:-1], points[1:]
    keep = np.isfinite(start).all(axis=1) & np.isfinite(end).all(axis=1)
    start, end = start[keep], end[keep]
    if len(start) == 0:
        return False
    x0, y0, x1, y1 = start[:, 0], start[:, 1], end[:, 0], end[:, 1]
    apart = (np.maximum(x0, x1) < box.x0) | (np.minimum(x0, x1) > box.x1)
    apart |= (np.maximum(y0, y1) < box.y0) | (np.minimum(y0, y1) > box.y1)
    corners = [(box.x0, box.y0), (box.x1, box.y0), (box.x1, box.y1), (box.x0, box.y1)]
    side = np.array([(x1 - x0) * (cy - y0) - (y1 - y0) * (cx - x0) for cx, cy in corners])
    apart |= (side > 0).all(axis=0) | (side < 0).all(axis=0)
    return bool((~apart).any())


def points_meet_box(points: np.ndarray, radius: np.ndarray | float, box: Bbox) -> bool:
    """Whether a marker of `radius` px around any of `points` (N x 2, display px) meets `box`."""
    if len(points) == 0 or _empty(box):
        return False
    radius = np.broadcast_to(np.asarray(radius, dtype=float), (len(points),))
    x, y = points[:, 0], points[:, 1]
    inside = (x + radius >= box.x0) & (x - radius <= box.x1) & (y + radius >= box.y0) & (y - radius <= box.y1)
    return bool(inside.any())


def _line_meets(line: Line2D, box: Bbox, dpi: float) -> bool:
    if _empty(box):
        return False
    xy = np.asarray(line.get_path().vertices, dtype=float)
    style = line.get_drawstyle() or "default"
    if style != "default" and len(xy):
        xy = np.column_stack(STEP_LOOKUP_MAP[style](xy[:, 0], xy[:, 1]))
    points = line.get_transform().transform(xy) if len(xy) else xy.reshape(0, 2)
    px = dpi / 72
    if line.get_linestyle() not in ("None", "none", "", " ") and line.get_linewidth() > 0:
        if segments_meet_box(points, _grown(box, line.get_linewidth() * px / 2)):
            return True
    marker = line.get_marker()
    if marker not in (None, "None", "none", "", " "):
        radius = (line.get_markersize() + line.get_markeredgewidth()) * px / 2
        finite = points[np.isfinite(points).all(axis=1)]
        return points_meet_box(finite, radius, box)
    return False


def _patch_meets(patch: Patch, box: Bbox) -> bool:
    if _empty(box):
        return False
    path = patch.get_transform().transform_path(patch.get_path())
    return bool(path.intersects_bbox(box, filled=patch.get_fill()))


def _collection_meets(collection: Collection, box: Bbox, dpi: float) -> bool:
    if _empty(box):
        return False
    px = dpi / 72
    widths = np.asarray(collection.get_linewidth(), dtype=np.float64)
    half_width = float(widths.max()) * px / 2 if widths.size else 0.0
    if isinstance(collection, PathCollection):
        # scatter: a marker of area `size` pt^2 around each offset
        offsets = collection.get_offset_transform().transform(np.asarray(collection.get_offsets()))
        offsets = offsets[np.isfinite(offsets).all(axis=1)]
        sizes = np.asarray(collection.get_sizes(), dtype=float)
        if not sizes.size:
            return False
        radius = np.sqrt(np.resize(sizes, len(offsets))) * px / 2 + half_width
        return points_meet_box(offsets, radius, box)
    transform = collection.get_transform()
    if isinstance(collection, LineCollection):
        grown = _grown(box, half_width)
        return any(segments_meet_box(transform.transform(p.vertices), grown) for p in collection.get_paths())
    faces = np.asarray(collection.get_facecolor())
    filled = bool(faces.size and (faces[:, 3] > 0).any())
    return any(
        transform.transform_path(p).intersects_bbox(box, filled=filled) for p in collection.get_paths()
    )


def png_bytes(fig: Figure) -> bytes:
    """The figure as the book shows it: a PNG at `DPI`, its own size, with `check_figure`'s result in text
    chunks (`CHUNK_*`) for tools/browser_book.py."""
    check = check_figure(fig)
    metadata = {
        CHUNK_MIN_TEXT_PT: f"{check.min_text_pt:g}",
        CHUNK_LEGEND_OVERLAPS: json.dumps(check.legend_overlaps),
        CHUNK_TEXT_COLLISIONS: json.dumps(check.text_collisions),
    }
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches=None, metadata=metadata)
    return buffer.getvalue()


@dataclass(frozen=True)
class FigureImage:
    """What a PNG drawn by `png_bytes` says about itself: its check, and its pixels per inch (pHYs)."""

    min_text_pt: float
    dpi: float
    legend_overlaps: list[str]
    text_collisions: list[str]

    def text_px(self, shown_width: float, natural_width: float) -> float:
        """The smallest text's height in CSS px when the image's `natural_width` px are shown `shown_width` wide."""
        return rendered_text_px(self.min_text_pt, self.dpi, shown_width, natural_width)


def rendered_text_px(text_pt: float, dpi: float, shown_width: float, natural_width: float) -> float:
    """CSS px of text set at `text_pt` in a `dpi` image that is `natural_width` px wide and shown `shown_width`."""
    if not (dpi > 0 and natural_width > 0 and shown_width >= 0):
        raise ValueError(
            f"dpi={dpi}, natural width {natural_width}, shown {shown_width}: need positive sizes"
        )
    return text_pt * dpi / 72 * shown_width / natural_width


def read_png(data: bytes) -> FigureImage | None:
    """The kvlab chunks of a PNG, or None when it has none (it was not drawn by kvlab.book.plot)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        if image.format != "PNG":
            raise ValueError(f"not a PNG but {image.format}")
        chunks: dict[str, str] = dict(getattr(image, "text", {}))
        dpi = image.info.get("dpi")
    if CHUNK_MIN_TEXT_PT not in chunks:
        return None
    if not dpi:
        raise ValueError("a kvlab figure PNG without its pHYs chunk: its pixels per inch are unknown")
    return FigureImage(
        min_text_pt=float(chunks[CHUNK_MIN_TEXT_PT]),
        dpi=float(dpi[0]),
        legend_overlaps=list(json.loads(chunks.get(CHUNK_LEGEND_OVERLAPS, "[]"))),
        text_collisions=list(json.loads(chunks.get(CHUNK_TEXT_COLLISIONS, "[]"))),
    )


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


def log_axis(ax: Axes, axis: str = "y") -> None:
    """A log `axis` ("x" or "y") ticked at 1, 2 and 5 of each decade, in plain numbers (0.5, 1, 2, 5, 10, ...),
    not matplotlib's "5 × 10⁻¹"; no minor ticks."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    if target.get_scale() != "log":
        raise ValueError(f"log_axis: the {axis} axis is not on a log scale; set it first")
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=30))
    target.set_minor_locator(NullLocator())
    target.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))


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
