"""`make fork REPO=...` (tools/repo_url.py) points the book's reader-feedback buttons at the fork.

The "Edit this page" and "Open an issue" buttons (_config.yml html.use_edit_page_button, use_issues_button) take
their URL from repository.url, as the repository and Colab launch buttons do: Jupyter Book passes it to the theme.
"""

import shutil
from pathlib import Path

import repo_url
import yaml
from jupyter_book.config import yaml_to_sphinx

ROOT = Path(__file__).resolve().parents[1]
FORK = "https://github.com/someone/kvlab-fork"


def test_make_fork_points_the_edit_and_issue_buttons_at_the_fork(tmp_path, monkeypatch):
    shutil.copy(ROOT / "_config.yml", tmp_path / "_config.yml")
    shutil.copytree(
        ROOT / "book", tmp_path / "book", ignore=shutil.ignore_patterns("results", "_build", ".*")
    )
    monkeypatch.setattr(repo_url, "ROOT", tmp_path)
    monkeypatch.setattr(repo_url, "CONFIG", tmp_path / "_config.yml")
    before = yaml_to_sphinx(yaml.safe_load((ROOT / "_config.yml").read_text()))[0]["html_theme_options"]
    assert before["repository_url"] == repo_url.configured_url() != FORK
    repo_url.set_url(FORK)
    options = yaml_to_sphinx(yaml.safe_load((tmp_path / "_config.yml").read_text()))[0]["html_theme_options"]
    assert options["use_edit_page_button"] is True and options["use_issues_button"] is True
    assert options["repository_url"] == FORK
    # The edit button opens <url>/edit/<branch>/<path_to_docs>/<page>: the book's source at the repository root.
    assert (options["repository_branch"], options["path_to_docs"]) == ("main", ".")
    assert f"{FORK}/blob/main/LICENSE" in (tmp_path / "book" / "intro.md").read_text()
    assert all(repo_url.notebook_urls(lab) <= {FORK} for lab in repo_url.notebooks())
