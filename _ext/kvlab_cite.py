"""Sphinx extension: the `{cite-this-book}` directive, a "Cite this book" box built from CITATION.cff.

The box gives one reference line and a BibTeX entry, both from the CFF file at the source root (the file
GitHub's "Cite this repository" reads too), so the book's citation cannot drift from it: tools/release.py
sets the CFF's version and date, and the next build shows them. tests/test_citation.py checks the box.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from docutils import nodes
from sphinx.util.docutils import SphinxDirective

CFF = "CITATION.cff"
STATIC = Path(__file__).parent / "static"


def author_names(cff: dict) -> list[str]:
    """Each author as a reference names them: an entity by its name, a person as 'Family, G.'."""
    names = []
    for author in cff["authors"]:
        if "name" in author:
            names.append(author["name"])
        else:
            initials = " ".join(f"{part[0]}." for part in author.get("given-names", "").split())
            names.append(f"{author['family-names']}, {initials}".rstrip(", "))
    return names


def reference_parts(cff: dict) -> tuple[str, str, str, str]:
    """One APA-style reference in parts: the text before the title, the title (set in italics), the text after
    it and the URL (a link)."""
    year = str(cff["date-released"])[:4]
    url = cff.get("url") or cff["repository-code"]
    before = f"{', '.join(author_names(cff))} ({year}). "
    return before, cff["title"], f" (Version {cff['version']}) [Computer software]. ", url


def reference(cff: dict) -> str:
    return "".join(reference_parts(cff))


def bibtex(cff: dict, key: str = "kvlab") -> str:
    """A BibTeX entry of the same citation (entity authors braced, so BibTeX keeps them whole)."""
    names = " and ".join(n if "," in n else f"{{{n}}}" for n in author_names(cff))
    fields = {
        "author": names,
        "title": cff["title"],
        "year": str(cff["date-released"])[:4],
        "version": str(cff["version"]),
        "url": cff.get("url") or cff["repository-code"],
    }
    if cff.get("url") and cff.get("repository-code"):
        fields["note"] = f"Code: {cff['repository-code']}"
    body = ",\n".join(f"  {name} = {{{value}}}" for name, value in fields.items())
    return f"@software{{{key},\n{body}\n}}"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


class CiteThisBook(SphinxDirective):
    """`{cite-this-book}`: the reference line and BibTeX entry of CITATION.cff, in a titled box."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        path = Path(self.env.srcdir) / self.config.kvlab_citation_file
        self.env.note_dependency(str(path))
        cff = load(path)
        box = nodes.admonition(classes=["kvlab-cite", "tip"])
        box += nodes.title(text="Cite this book")
        before, title, after, url = reference_parts(cff)
        link = nodes.reference(url, url, refuri=url)
        box += nodes.paragraph(
            "", "", nodes.Text(before), nodes.emphasis(text=title), nodes.Text(after), link
        )
        box += nodes.literal_block(bibtex(cff), bibtex(cff), language="bibtex")
        box += nodes.paragraph(text=f"Both from the repository's {CFF}.")
        return [box]


def add_static(app, config):
    config.html_static_path.append(str(STATIC))


def setup(app):
    app.add_config_value("kvlab_citation_file", CFF, "env")
    app.add_directive("cite-this-book", CiteThisBook)
    app.connect("config-inited", add_static)
    app.add_css_file("kvlab_cite.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
