"""Sphinx extension: the built book reads offline. MathJax is served from `_static/mathjax`, not a CDN.

It also drops the explanation pages' JupyterLab-only note (a link to the rendered page, for readers who open
the Markdown in JupyterLab, where glue roles do not render), and a console error of sphinx-thebe.

The MathJax 3 files come from the pinned `django-static-mathjax` wheel (its `es5` build). Only what the
`tex-chtml` component loads is copied: the component itself, TeX extensions, CHTML fonts, the menu and a11y
parts it may load on demand. `_config.yml` points `mathjax_path` at `mathjax/tex-chtml.js`.
"""

import shutil
from pathlib import Path

JUPYTERLAB_ONLY = 'class="kvlab-jupyterlab-only"'
NEEDED = ["tex-chtml.js", "input", "output", "ui", "a11y", "adaptors"]


def mathjax_source() -> Path:
    import mathjax  # the django-static-mathjax package

    root = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if not (root / "tex-chtml.js").is_file():
        raise FileNotFoundError(
            f"MathJax's tex-chtml.js is missing under {root}; pip install -r requirements.txt"
        )
    return root


def check_config(app, config):
    if "://" in config.mathjax_path:
        raise ValueError(f"mathjax_path must be a local file under _static, not {config.mathjax_path!r}")
    # The theme's colour mode starts empty ("Got invalid theme mode" in the console); figures are drawn on white.
    config.html_context.setdefault("default_mode", "light")


def dedupe_scripts(app, pagename, templatename, context, doctree):
    """Drop repeated inline scripts: sphinx-thebe adds its `const THEBE_JS_URL` twice, a console error.

    The copies differ only in `filename` (None or ""), so they are compared by file and inline body.
    """
    seen, unique = set(), []
    for script in context.get("script_files", []):
        key = (getattr(script, "filename", script) or "", getattr(script, "attributes", {}).get("body", ""))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"][:] = unique  # in place: later handlers may still add their own


def drop_jupyterlab_notes(app, doctree):
    """Remove raw-HTML notes meant for JupyterLab readers only (`<p class="kvlab-jupyterlab-only">`)."""
    from docutils import nodes

    for node in list(doctree.findall(nodes.raw)):
        if JUPYTERLAB_ONLY in node.astext():
            node.parent.remove(node)


def copy_mathjax(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    source, target = mathjax_source(), Path(app.outdir) / "_static" / "mathjax"
    for name in NEEDED:
        if (source / name).is_dir():
            shutil.copytree(source / name, target / name, dirs_exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, target / name)


def setup(app):
    mathjax_source()  # fail early, before executing any notebook
    app.connect("config-inited", check_config)
    app.connect("doctree-read", drop_jupyterlab_notes)
    app.connect("html-page-context", dedupe_scripts, priority=900)  # after the handlers that add scripts
    app.connect("build-finished", copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
