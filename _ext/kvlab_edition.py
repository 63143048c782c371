"""Sphinx extension: the English and the Chinese edition of the book, each a whole build, linked page to page.

The English edition is built from `_config.yml` and `_toc.yml` into `_build/html`; the Chinese one from the same
sources with `_config_zh.yml`'s overrides and `_toc_zh.yml` into `_build/html/zh` (tools/book_config.py, `make
book`). The Chinese pages live in `book/zh/` (`book/zh/02_sizing.md` translates `book/02_sizing/index.md`); the
labs are not translated, and the Chinese edition carries the English labs as the sections of its chapters, so
that its pages glue the labs' stored outputs and link them inside one build.

`kvlab_edition` (`en` or `zh`) names the edition being built. This extension

- puts one line at the top of every HTML page, linking the same page in the other edition (中文版 / English);
  the PDF (singlehtml) gets none, as it is the English edition alone;
- resolves a Markdown link to a page this build lacks: in the Chinese edition, a lab's link to an English chapter
  (`../02_sizing/index.md`) opens the Chinese chapter; any other link to a page of the other edition becomes a
  relative URL to it (the English intro links `zh/intro.md`, a Chinese page may link `../02_sizing/index.md`).
"""

from __future__ import annotations

import posixpath
import re

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform

EDITIONS = ("en", "zh")
# Where the Chinese edition's root lies, seen from the English one's (the deployed site: /zh/).
ZH_ROOT = "zh"
CHAPTER = re.compile(r"^book/(?P<chapter>[^/]+)/index$")
ZH_PAGE = re.compile(r"^book/zh/(?P<chapter>[^/]+)$")
FIGURES_IN_ENGLISH = '<span class="kvlab-figures-note">本页的图由英文实验绘制，图中文字为英文。</span> '
LABEL = {"en": ("中文版", "zh-CN", "本页的中文版"), "zh": ("English", "en", "This page in English")}


def counterpart(docname: str, edition: str) -> str | None:
    """The other edition's docname for this page: `book/02_sizing/index` <-> `book/zh/02_sizing`.

    The intro is `book/intro` <-> `book/zh/intro`. A lab (`book/NN_x/lab`) is English in both editions: the
    English edition's lab pairs with the Chinese chapter, the Chinese edition's copy with the English lab.
    None for pages of neither kind (an index, a search page).
    """
    if edition == "en":
        if docname == "book/intro":
            return "book/zh/intro"
        if match := CHAPTER.match(docname):
            return f"book/zh/{match['chapter']}"
        if docname.startswith("book/") and docname.endswith("/lab") and docname.count("/") == 2:
            return f"book/zh/{docname.split('/')[1]}"
        return None
    if docname == "book/zh/intro":
        return "book/intro"
    if match := ZH_PAGE.match(docname):
        return f"book/{match['chapter']}/index"
    if docname.startswith("book/") and docname.endswith("/lab") and docname.count("/") == 2:
        return docname
    return None


def other_edition_uri(from_docname: str, target_docname: str, edition: str) -> str:
    """Relative URL from a page of this edition to a page of the other one (both built as `<docname>.html`)."""
    target = f"{target_docname}.html"
    if edition == "en":
        target = f"{ZH_ROOT}/{target}"
    else:
        target = f"../{target}"
    return posixpath.relpath(target, posixpath.dirname(from_docname) or ".")


def edition_of(config) -> str:
    if config.kvlab_edition not in EDITIONS:
        raise ValueError(f"kvlab_edition must be one of {EDITIONS}, not {config.kvlab_edition!r}")
    return config.kvlab_edition


class CrossEditionLinks(SphinxPostTransform):
    """Markdown links to a page this build lacks but the other edition has (before MyST resolves them)."""

    default_priority = 8  # before myst-parser's MystReferenceResolver (9), which warns on unknown documents

    def run(self, **kwargs) -> None:
        edition = edition_of(self.config)
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
                continue
            target = node["reftarget"]
            if target in self.env.all_docs:
                continue
            # A lab is English in both editions: in the Chinese one, its link to a chapter opens the Chinese page.
            # A Chinese page that links an English page means the English one.
            shared = edition == "zh" and not self.env.docname.startswith("book/zh/")
            here = counterpart(target, "en")
            if shared and here is not None and here in self.env.all_docs:
                node["reftarget"] = here
                continue
            if edition == "en" and not target.startswith("book/zh/"):
                continue  # not a Chinese page: MyST's own warning names it
            uri = other_edition_uri(self.env.docname, target, edition)
            if node.get("reftargetid"):
                uri += "#" + node["reftargetid"]
            reference = nodes.reference("", "", internal=False, refuri=uri)
            reference.extend(child.deepcopy() for child in node.children)
            node.replace_self(reference)


def edition_link(app, pagename, templatename, context, doctree) -> None:
    """Prepend the other edition's link to the page body (HTML builders only: not the singlehtml of the PDF)."""
    if app.builder.name not in ("html", "dirhtml") or doctree is None or "body" not in context:
        return
    edition = edition_of(app.config)
    target = counterpart(pagename, edition)
    if target is None:
        return
    text, lang, title = LABEL[edition]
    uri = other_edition_uri(pagename, target, edition)
    # The labs draw the figures, in English: a Chinese page with figures says so once, beside the link.
    note = FIGURES_IN_ENGLISH if edition == "zh" and "<img" in context["body"] else ""
    # <nav>: page chrome, not prose (tools/prose.py skips it).
    context["body"] = (
        f'<nav class="kvlab-edition" aria-label="{title}" style="text-align: right">{note}<a href="{uri}" hreflang="{lang}" lang="{lang}"'
        f' title="{title}">{text}</a></nav>\n' + context["body"]
    )


# How the Chinese edition's previous/next buttons mark a page that is in English (its labs).
ENGLISH_NEIGHBOUR = "（英文）"


def label_english_neighbours(app, pagename, templatename, context, doctree) -> None:
    """In the Chinese edition, the previous/next buttons say when they lead to an English page (a lab), so that
    "下一页" never opens English without a word."""
    if edition_of(app.config) != "zh":
        return
    for key in ("prev", "next"):
        neighbour = context.get(key)
        if not neighbour or not neighbour.get("link"):
            continue
        target = posixpath.normpath(posixpath.join(posixpath.dirname(pagename), neighbour["link"]))
        if not target.startswith("book/zh/") and not neighbour["title"].endswith(ENGLISH_NEIGHBOUR):
            context[key] = dict(neighbour, title=neighbour["title"] + ENGLISH_NEIGHBOUR)


def setup(app):
    app.add_config_value("kvlab_edition", "en", "env")
    app.add_post_transform(CrossEditionLinks)
    app.connect("html-page-context", edition_link)
    app.connect("html-page-context", label_english_neighbours)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
