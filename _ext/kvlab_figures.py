"""Sphinx extension: kvlab_figures.css, which keeps figure text readable on a narrow screen.

Figures are shown at the column's width; on a phone that would shrink their text under 9 CSS px, so the CSS
gives them a minimum width and lets them scroll sideways (the numbers are in the CSS file, the check in
tools/browser_book.py).
"""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"
CSS = "kvlab_figures.css"


def add_static(app, config):
    # _ext/kvlab_cite.py adds the same folder; a folder listed twice is copied twice, so add it once.
    if str(STATIC) not in config.html_static_path:
        config.html_static_path.append(str(STATIC))


def setup(app):
    app.connect("config-inited", add_static)
    app.add_css_file(CSS)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
