"""Sphinx extension: kvlab_figures.css and kvlab_figures.js, which keep figures and tables readable on a phone.

Figures are shown at the column's width; on a phone that would shrink their text under 9 CSS px, so the CSS
gives them a minimum width and lets them scroll sideways (the numbers are in the CSS file). The script stacks a
prose table wider than its column, one block per row, and puts a line saying "scroll sideways" above whatever
still scrolls. tools/browser_book.py checks both at 1280 and 412 px.
"""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"
CSS = "kvlab_figures.css"
JS = "kvlab_figures.js"


def add_static(app, config):
    # _ext/kvlab_cite.py adds the same folder; a folder listed twice is copied twice, so add it once.
    if str(STATIC) not in config.html_static_path:
        config.html_static_path.append(str(STATIC))


def setup(app):
    app.connect("config-inited", add_static)
    app.add_css_file(CSS)
    app.add_js_file(JS, loading_method="defer")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
