"""Sphinx extension: the {kvlab-calculator} directive, kvlab's sizing run in the reader's browser (book/calculator).

The page carries a form whose fields are `kvlab size`'s own long flags (their choices read from its argparse
parser, the models from the registry, the GPUs from the spec table) and one module script,
`_static/calculator/calculator.js`, added to that page only (a classic script: it imports Pyodide's module itself, and from file:// it says the book must be served over HTTP). The script loads Pyodide and kvlab's source from the
built book when the page opens, and answers with `kvlab.calculator`, i.e. `kvlab size ... --json`.

At the end of an HTML build it copies into `_static/calculator/`:

- `pyodide/`: Pyodide's core (the WebAssembly CPython, its loader and its standard library), from the npm
  package pinned in tools/calculator/package-lock.json (`make install` runs `npm ci` there); no Python package
  of Pyodide's own is needed;
- `kvlab.zip`: the kvlab package's Python files and data (src/kvlab), which the page unpacks into site-packages.

Nothing is fetched from a CDN: the page works offline from `_build/html`.
"""

from __future__ import annotations

import html
import shutil
import zipfile
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive

ROOT = Path(__file__).resolve().parent.parent
PYODIDE = ROOT / "tools" / "calculator" / "node_modules" / "pyodide"
SCRIPT = ROOT / "tools" / "calculator" / "calculator.js"
STYLE = ROOT / "tools" / "calculator" / "calculator.css"
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


class CalculatorDirective(Directive):
    has_content = False

    def run(self):
        env = self.state.document.settings.env
        env.kvlab_calculator_pages = getattr(env, "kvlab_calculator_pages", set()) | {env.docname}
        edition = env.config.kvlab_edition if env.config.kvlab_edition in LABELS else "en"
        return [nodes.raw("", form_html(edition), format="html")]


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


def setup(app):
    pyodide_source()  # fail early, before executing any notebook
    app.add_directive("kvlab-calculator", CalculatorDirective)
    app.connect("html-page-context", add_script)
    app.connect("env-merge-info", merge_pages)
    app.connect("env-purge-doc", purge_page)
    app.connect("build-finished", copy_calculator)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
