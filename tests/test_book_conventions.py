"""Every lab follows the book's conventions (see README, "Notebook conventions")."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import repo_url  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LABS = repo_url.notebooks()
TOC = (ROOT / "_toc.yml").read_text()


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def source(cell):
    return "".join(cell["source"])


def test_there_are_labs():
    assert len(LABS) >= 2


@pytest.mark.parametrize("lab", LABS, ids=lambda p: str(p.relative_to(ROOT)))
def test_lab_conventions(lab):
    cells = code_cells(lab)
    assert "parameters" in cells[0].get("metadata", {}).get("tags", []), (
        "first code cell is tagged parameters"
    )
    assert '"google.colab" in sys.modules' in source(cells[1]), "second cell installs kvlab on Colab only"
    provenance = next(c for c in cells if "env_report(" in source(c))
    assert source(provenance).startswith("# NBVAL_IGNORE_OUTPUT")
    assert all(c.get("execution_count") for c in cells), "committed with outputs from a full run"
    assert not any(o.get("output_type") == "error" for c in cells for o in c.get("outputs", []))
    assert any(re.search(r"^\s*assert ", source(c), re.M) for c in cells), "labs assert their claims"
    assert any("glue(" in source(c) for c in cells)
    text = "\n".join(source(c) for c in cells)
    assert "kvlab.pick_device()" in text, "labs pick cuda when available, else cpu"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: str(p.relative_to(ROOT)))
def test_chapter_page_and_lab_are_in_toc(lab):
    chapter = lab.parent.relative_to(ROOT)
    assert f"file: {chapter}/index" in TOC and f"file: {chapter}/lab" in TOC
    page = (lab.parent / "index.md").read_text()
    assert "src/kvlab/" in page, "each chapter links to its kvlab module"
    for key in re.findall(r"lab\.ipynb::(\w+)", page):
        assert f'glue("{key}"' in lab.read_text().replace('\\"', '"'), f"{key} is glued by the lab"


def test_repository_url_in_one_place():
    url = repo_url.configured_url()
    for lab in LABS:
        assert repo_url.notebook_urls(lab) <= {url}, lab
