"""Sphinx extension: the {kvlab-calculator} directive, kvlab's sizing run in the reader's browser (book/calculator).

The page carries a form whose fields are `kvlab size`'s own long flags (their choices read from its argparse
parser, the models from the registry, the GPUs from the spec table) and one module script,
`_static/calculator/calculator.js`, added to that page only (a classic script: it imports Pyodide's module itself, and from file:// it says the book must be served over HTTP). The script loads Pyodide and kvlab's source from the
built book when the page opens, and answers with `kvlab.calculator`, i.e. `kvlab size ... --json`.

At the end of an HTML build it copies into `_static/calculator/`:

- `pyodide/`: Pyodide's core (the WebAssembly CPython, its loader and its standard library), from the npm
  package pinned in tools/calculator/package-lock.json (`make install` runs `npm ci` there); no Python package
  of Pyodide's own is needed;
- `kvlab.zip`: the kvlab package's Python files and data (src/kvlab), which the page unpacks into site-packages;
- `kvlab.snapshot.gz`: Pyodide's memory once CPython has booted and imported kvlab.calculator, made by Node
  (tools/calculator/snapshot.mjs) from the same two; the page restores it instead of booting Python itself,
  which took most of the first result's time. The English and Chinese builds share one, kept in
  _build/calculator-snapshot/ under the hash of its inputs.

Nothing is fetched from a CDN: the page works offline from `_build/html`.

The printed book (`make pdf`, the singlehtml builder) and any other builder get a note instead of the form: the
page's address on the site (CITATION.cff's url) and the `kvlab size ... --json` command that prints its figures.
"""

from __future__ import annotations

import hashlib
import html
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import zipfile
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx import addnodes

ROOT = Path(__file__).resolve().parent.parent
PYODIDE = ROOT / "tools" / "calculator" / "node_modules" / "pyodide"
SCRIPT = ROOT / "tools" / "calculator" / "calculator.js"
STYLE = ROOT / "tools" / "calculator" / "calculator.css"
SNAPSHOT_SCRIPT = ROOT / "tools" / "calculator" / "snapshot.mjs"
# Snapshots made by earlier builds, by the hash of their inputs (one kept).
SNAPSHOT_CACHE = ROOT / "_build" / "calculator-snapshot"
PACKAGE = ROOT / "src" / "kvlab"
# Pyodide's core: the loader, the WebAssembly CPython and its standard library, and the lock file it reads.
CORE = ["pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json"]
# The flags of `kvlab size` the form offers, in its order; each field's name is the flag without its dashes.
FIELDS = [
    "context", "batch", "kv-dtype", "weight-dtype", "gpu", "tp", "pp", "vllm-version",
    "window", "sinks", "images", "image-size", "limit-images",
]  # fmt: skip
LABELS = {
    "en": {
        "model": "Model", "config": "or paste a config.json", "context": "Context (tokens, e.g. 32k)",
        "batch": "Concurrent sequences", "kv-dtype": "KV cache precision", "weight-dtype": "Weight precision",
        "gpu": "GPU", "tp": "Tensor parallel (TP)", "pp": "Pipeline parallel (PP)",
        "vllm-version": "vLLM version", "window": "Eviction window (tokens)", "sinks": "Sink tokens",
        "images": "Images per request", "image-size": "Image size (WxH)", "limit-images": "Image limit (server)",
        "none": "none", "default": "default", "loading": "Loading Python in your browser…",
    },
    "zh": {
        "model": "模型", "config": "或粘贴 config.json", "context": "上下文（token，如 32k）",
        "batch": "并发序列数", "kv-dtype": "KV 缓存精度", "weight-dtype": "权重精度",
        "gpu": "GPU", "tp": "张量并行（TP）", "pp": "流水线并行（PP）",
        "vllm-version": "vLLM 版本", "window": "淘汰窗口（token）", "sinks": "sink token 数",
        "images": "每个请求的图片数", "image-size": "图片尺寸（宽x高）", "limit-images": "图片上限（服务端）",
        "none": "无", "default": "默认", "loading": "正在浏览器中加载 Python……",
    },
}  # fmt: skip


def _size_actions() -> dict[str, object]:
    """`kvlab size`'s argparse actions by long flag name without dashes."""
    from kvlab import cli

    parser = cli.build_parser("size")
    sub = next(a for a in parser._actions if a.dest == "command").choices["size"]
    return {
        a.option_strings[0][2:]: a
        for a in sub._actions
        if a.option_strings[:1] != ["-h"] and a.option_strings
    }


def _choices(name: str, action) -> list[str] | None:
    from kvlab.specs import hardware, vllm_defaults

    if name == "gpu":
        return ["", *hardware.registry()]
    if name == "vllm-version":
        return ["", *(r.version for r in vllm_defaults.RELEASES)]
    return [str(c) for c in action.choices] if action.choices else None


def form_html(edition: str) -> str:
    """The calculator's form, results area and status line."""
    from kvlab.specs import arch

    words = LABELS[edition]
    actions = _size_actions()
    esc = html.escape
    models = "".join(f'<option value="{esc(m)}">{esc(m)}</option>' for m in arch.registry())
    rows = [
        f'<label class="kvlab-calc-field kvlab-calc-wide">{words["model"]}'
        f'<select name="model" data-default="meta-llama/Llama-3.1-8B">{models}</select></label>',
        f'<label class="kvlab-calc-field kvlab-calc-wide">{words["config"]}'
        '<textarea name="config" rows="3" spellcheck="false" placeholder="{&quot;model_type&quot;: ...}">'
        "</textarea></label>",
    ]
    for name in FIELDS:
        action = actions.get(name)
        if action is None:
            # a flag this kvlab's `kvlab size` lacks (the form follows the CLI, not the reverse)
            continue
        default = "" if action.default in (None, False) else str(action.default)
        choices = _choices(name, action)
        if choices is not None:
            options = "".join(
                f'<option value="{esc(c)}">{esc(c) if c else words["default" if name != "gpu" else "none"]}'
                "</option>"
                for c in choices
            )
            field = f'<select name="{name}" data-default="{esc(default)}">{options}</select>'
        else:
            field = f'<input name="{name}" type="text" inputmode="text" data-default="{esc(default)}">'
        rows.append(f'<label class="kvlab-calc-field">{words[name]}{field}</label>')
    return (
        f'<div class="kvlab-calculator" data-edition="{edition}">'
        f'<form class="kvlab-calc-form" autocomplete="off">{"".join(rows)}</form>'
        f'<p class="kvlab-calc-status" role="status">{words["loading"]}</p>'
        '<div class="kvlab-calc-result" aria-live="polite"></div>'
        "</div>"
    )


# Where a printed book (the PDF, tools/pdf.py: one singlehtml page) sends its reader instead of showing a form
# that cannot run there: the page on the site (CITATION.cff's url) and the command line.
PAGE_PATHS = {"en": "book/calculator/index.html", "zh": "zh/book/zh/calculator.html"}
PRINTED = {
    "en": (
        "The calculator runs in the web edition of this book: ",
        ". On your own machine, ",
        " prints the same figures.",
    ),
    "zh": ("计算器在本书的网页版中运行：", "。在你自己的机器上，", " 给出相同的数字。"),
}
COMMAND = "kvlab size meta-llama/Llama-3.1-8B --context 32k --gpu H100-SXM --json"


def site_url() -> str:
    """The book's address on the web, from CITATION.cff (`make fork` and the Pages workflow keep it)."""
    for line in (ROOT / "CITATION.cff").read_text().splitlines():
        if line.startswith("url:"):
            return line.split(":", 1)[1].strip().strip('"').rstrip("/") + "/"
    raise ValueError("CITATION.cff has no url: the printed calculator page cannot point to the site")


def printed_note(edition: str) -> nodes.note:
    """What the PDF shows in the form's place: the page's address and the command that prints its figures."""
    url = site_url() + PAGE_PATHS[edition]
    before, middle, after = PRINTED[edition]
    para = nodes.paragraph()
    para += [
        nodes.Text(before),
        nodes.reference(url, url, refuri=url),
        nodes.Text(middle),
        nodes.literal(COMMAND, COMMAND),
        nodes.Text(after),
    ]
    note = nodes.note()
    note += para
    return note


# The calculator page of each edition, as a document name.
PAGE_DOCS = {"en": "book/calculator/index", "zh": "book/zh/calculator"}
ROLE = re.compile(r"(?P<label>.*?)\s*<(?P<query>[^<>]*)>", re.S)


def calculator_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """`{kvlab-calc}`size your own model <model=Qwen/Qwen3-8B&context=32k&gpu=H100-SXM>``: a link to the
    calculator page with a chapter's own example in its URL (the page reads its settings from there). The
    settings are `kvlab size`'s long flags without dashes; the build fails when the form has no such field or
    `kvlab size` refuses them, so a chapter cannot link to a setting the page would answer with an error."""
    from kvlab.calculator import calculate

    env = inliner.document.settings.env
    found = ROLE.fullmatch(text)
    try:
        if found is None:
            raise ValueError("write {kvlab-calc}`label <model=...&context=...>`")
        args = dict(urllib.parse.parse_qsl(found["query"], strict_parsing=True))
        unknown = sorted(set(args) - {"model", *FIELDS})
        if unknown:
            raise ValueError(f"the calculator has no field {', '.join(unknown)}")
        answer = calculate(args)
        if "error" in answer:
            raise ValueError(f"kvlab size refuses {found['query']}: {answer['error']}")
    except ValueError as err:
        message = inliner.reporter.error(f"kvlab-calc: {err}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, message)], [message]
    edition = env.config.kvlab_edition if env.config.kvlab_edition in LABELS else "en"
    query = urllib.parse.urlencode(args)
    if env.app.builder.format == "html" and env.app.builder.name != "singlehtml":
        uri = env.app.builder.get_relative_uri(env.docname, PAGE_DOCS[edition])
    else:
        # a printed book links to the page on the site
        uri = site_url() + PAGE_PATHS[edition]
    return [nodes.reference(rawtext, found["label"], refuri=f"{uri}?{query}")], []


class CalculatorDirective(Directive):
    has_content = False

    def run(self):
        env = self.state.document.settings.env
        env.kvlab_calculator_pages = getattr(env, "kvlab_calculator_pages", set()) | {env.docname}
        edition = env.config.kvlab_edition if env.config.kvlab_edition in LABELS else "en"
        # The form runs on the HTML pages only; singlehtml is what tools/pdf.py prints, where it would be dead.
        live = addnodes.only(expr="format_html and not builder_singlehtml")
        live += nodes.raw("", form_html(edition), format="html")
        printed = addnodes.only(expr="not format_html or builder_singlehtml")
        printed += printed_note(edition)
        return [live, printed]


def add_script(app, pagename, templatename, context, doctree):
    if pagename in getattr(app.env, "kvlab_calculator_pages", set()):
        app.add_js_file("calculator/calculator.js", defer="defer")
        app.add_css_file("calculator/calculator.css")


def merge_pages(app, env, docnames, other):
    env.kvlab_calculator_pages = getattr(env, "kvlab_calculator_pages", set()) | getattr(
        other, "kvlab_calculator_pages", set()
    )


def purge_page(app, env, docname):
    env.kvlab_calculator_pages = getattr(env, "kvlab_calculator_pages", set()) - {docname}


def pyodide_source() -> Path:
    missing = [name for name in CORE if not (PYODIDE / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Pyodide's {', '.join(missing)} missing under {PYODIDE}: run make install (npm ci in tools/calculator)"
        )
    return PYODIDE


def write_kvlab_zip(path: Path) -> None:
    """kvlab's Python files and package data, as the page's site-packages/kvlab (no caches)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for file in sorted(PACKAGE.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix in (".py", ".json", ".txt"):
                # a fixed date: the same source gives the same bytes
                info = zipfile.ZipInfo(str(file.relative_to(PACKAGE.parent)), date_time=(2020, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, file.read_bytes())


def node() -> str:
    found = shutil.which("node")
    if found is None:
        raise FileNotFoundError(
            "no node on PATH: the calculator's snapshot is made by Node (apt-get install nodejs npm; make install)"
        )
    return found


def write_snapshot(kvlab_zip: Path, path: Path) -> None:
    """The page's memory snapshot (tools/calculator/snapshot.mjs) for this Pyodide and this kvlab.zip, made
    once per change of either and copied from _build/calculator-snapshot/ otherwise."""
    digest = hashlib.sha256()
    for source in [*(pyodide_source() / name for name in CORE), SNAPSHOT_SCRIPT, kvlab_zip]:
        digest.update(source.read_bytes())
    cached = SNAPSHOT_CACHE / f"{digest.hexdigest()[:16]}.gz"
    if not cached.is_file():
        SNAPSHOT_CACHE.mkdir(parents=True, exist_ok=True)
        # Another build may be making or reading a snapshot beside this one: each writes its own partial file,
        # and only snapshots an hour old are removed.
        for old in SNAPSHOT_CACHE.glob("*.gz"):
            if time.time() - old.stat().st_mtime > 3600:
                old.unlink(missing_ok=True)
        partial = cached.with_name(f"{cached.stem}.{os.getpid()}.partial")
        made = subprocess.run(
            [node(), str(SNAPSHOT_SCRIPT), str(pyodide_source()), str(kvlab_zip), str(partial)],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise RuntimeError(f"the calculator's snapshot failed: {made.stderr.strip()[-2000:]}")
        partial.rename(cached)
    shutil.copy2(cached, path)


def copy_calculator(app, exception):
    if exception is not None or app.builder.format != "html" or app.builder.name == "singlehtml":
        return
    target = Path(app.outdir) / "_static" / "calculator"
    (target / "pyodide").mkdir(parents=True, exist_ok=True)
    for name in CORE:
        shutil.copy2(pyodide_source() / name, target / "pyodide" / name)
    shutil.copy2(SCRIPT, target / "calculator.js")
    shutil.copy2(STYLE, target / "calculator.css")
    write_kvlab_zip(target / "kvlab.zip")
    write_snapshot(target / "kvlab.zip", target / "kvlab.snapshot.gz")


def setup(app):
    # fail early, before executing any notebook
    pyodide_source()
    node()
    app.add_directive("kvlab-calculator", CalculatorDirective)
    app.add_role("kvlab-calc", calculator_role)
    app.connect("html-page-context", add_script)
    app.connect("env-merge-info", merge_pages)
    app.connect("env-purge-doc", purge_page)
    app.connect("build-finished", copy_calculator)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
