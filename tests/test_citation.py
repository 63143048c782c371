"""CITATION.cff is valid CFF 1.2.0, and the intro page's "Cite this book" box (_ext/kvlab_cite.py) matches it.

The schema is the CFF project's own schema.json for 1.2.0, read from the cffconvert 2.0.0 wheel, which ships it
(installed --no-deps by the Makefile: cffconvert pins jsonschema<4, which jupyter-book's stack outgrew), and
checked with the jsonschema of this venv. Its source:
https://github.com/citation-file-format/citation-file-format/blob/1.2.0/schema.json
"""

import json
import shutil
import sys
from importlib import metadata
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "_ext"))

import kvlab_cite  # noqa: E402

CFF = ROOT / "CITATION.cff"


def cff_schema() -> dict:
    """CFF 1.2.0's JSON schema from the installed cffconvert distribution's files (the package is not imported)."""
    files = metadata.files("cffconvert") or []
    path = next(f for f in files if str(f).endswith("schemas/1.2.0/schema.json"))
    return json.loads(path.read_text())


def test_citation_cff_is_valid_cff_1_2_0():
    schema = cff_schema()
    assert schema["$id"] == "https://citation-file-format.github.io/1.2.0/schema.json"
    cff = yaml.safe_load(CFF.read_text())
    validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(cff)]
    assert not errors, errors


def test_the_validation_catches_a_broken_file():
    cff = yaml.safe_load(CFF.read_text())
    del cff["authors"]
    cff["date-released"] = "1 December 2026"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cff, cff_schema(), format_checker=jsonschema.FormatChecker())


def test_the_citation_is_built_from_the_cff():
    cff = yaml.safe_load(CFF.read_text())
    line = kvlab_cite.reference(cff)
    assert line.startswith("kvlab contributors (2026). kvlab: the KV-cache lab book (Version ")
    assert str(cff["version"]) in line and cff["url"] in line
    entry = kvlab_cite.bibtex(cff)
    assert entry.startswith("@software{kvlab,") and "author = {{kvlab contributors}}" in entry
    assert f"version = {{{cff['version']}}}" in entry
    person = {**cff, "authors": [{"family-names": "Lovelace", "given-names": "Ada Augusta"}]}
    assert kvlab_cite.reference(person).startswith("Lovelace, A. A. (2026).")


def test_the_intro_page_shows_the_box():
    intro = (ROOT / "book" / "intro.md").read_text()
    assert "```{cite-this-book}\n```" in intro
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["sphinx"]["local_extensions"]["kvlab_cite"] == "_ext"


def test_the_rendered_box_matches_the_cff(tmp_path):
    """A one-page Sphinx project with the extension: the HTML box says what the CFF says."""
    from sphinx.application import Sphinx

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(CFF, src / "CITATION.cff")
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / '_ext')!r})\nextensions = ['kvlab_cite']\n"
    )
    (src / "index.rst").write_text("Book\n====\n\n.. cite-this-book::\n")
    app = Sphinx(src, src, tmp_path / "html", tmp_path / "doctrees", "html", status=None, warningiserror=True)
    app.build()
    html = (tmp_path / "html" / "index.html").read_text()
    cff = yaml.safe_load(CFF.read_text())
    assert "Cite this book" in html
    url = cff["url"]
    assert (
        f'<em>{cff["title"]}</em> (Version {cff["version"]}) [Computer software]. <a class="reference external" href="{url}">{url}</a>'
        in html
    )
    # The box's BibTeX wraps on a narrow screen (its stylesheet is linked and copied).
    assert "_static/kvlab_cite.css" in html and (tmp_path / "html" / "_static" / "kvlab_cite.css").is_file()
    assert "@software" in html and cff["repository-code"] in html
