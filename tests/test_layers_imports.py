"""kvlab's modules import one another without a cycle, counting every import: at the top of a module, inside a
function (a deferred import hides a cycle rather than removing it) or under `TYPE_CHECKING`.

Each module under src/kvlab is parsed with `ast`; the graph has an edge from a module to every kvlab module it
names in an `import` or `from ... import` (relative imports resolved, `from kvlab import x` read as the module
`kvlab.x` where one exists, else as the package). The implicit import of a parent package when a submodule is
imported is not an edge: Python has the parent in `sys.modules` before any of its submodules runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "kvlab"

# Edges (importer, imported) allowed to close a cycle for now, each with a comment saying who removes it.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def module_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__.py)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` imports: itself, or the innermost package of it that is a module (`kvlab.x.attr`)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvlab modules `module` (at `path`) imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # A relative import counts its dots from the module's package (the module itself for a package).
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from kvlab import x` imports the module kvlab.x where there is one, else a name of kvlab.
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != module:
                    found.add(resolved)
    return found


def import_graph(src: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(src, package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm), each written
    as the path a -> b -> ... -> a along the graph's edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def without_known(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {
        node: {t for t in targets if (node, t) not in KNOWN_CYCLE_EDGES} for node, targets in graph.items()
    }


def test_kvlab_has_no_import_cycle():
    cycles = find_cycles(without_known(import_graph()))
    assert not cycles, "import cycles among kvlab's modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_known_cycle_edges_still_exist():
    graph = import_graph()
    stale = [edge for edge in KNOWN_CYCLE_EDGES if edge[1] not in graph.get(edge[0], set())]
    assert not stale, f"known cycle edges no longer in the code, remove them from KNOWN_CYCLE_EDGES: {stale}"


def test_the_graph_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from kvlab.a import x\n")
    (pkg / "a.py").write_text("def f():\n    from kvlab import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvlab.sub.c\n")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("from ..a import f\nfrom kvlab import name_of_the_package\n")
    graph = import_graph(tmp_path)
    assert graph == {
        "kvlab": {"kvlab.a"},
        "kvlab.a": {"kvlab.b"},
        "kvlab.b": {"kvlab.sub.c"},
        "kvlab.sub": {"kvlab.sub.c"},
        "kvlab.sub.c": {"kvlab.a", "kvlab"},
    }
    assert find_cycles(graph) == [["kvlab", "kvlab.a", "kvlab.b", "kvlab.sub.c", "kvlab"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


# The layers from the bottom up (docs/modules.md): a module may import from its own layer and the ones before it.
LAYERS = [
    {"kvlab.checks", "kvlab.units", "kvlab.version", "kvlab.env", "kvlab.claims", "kvlab.measure"}
    | {"kvlab.agreement", "kvlab.kv_format"},
    {"kvlab.specs"},
    {"kvlab.models"},
    {"kvlab.costs"},
    {"kvlab.engine"},
    {"kvlab.offload", "kvlab.disagg"},
    {"kvlab.planning"},
    {"kvlab.experiments"},
    {"kvlab.book"},
    {"kvlab.cli", "kvlab.calculator"},
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the module's layer: its top-level module or package under kvlab."""
    top = ".".join(module.split(".")[:2])
    found = [i for i, layer in enumerate(LAYERS) if top in layer]
    if not found:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/modules.md")
    return found[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge from a module to one in a higher layer, as 'importer -> imported'."""
    return [
        f"{node} -> {target}"
        for node, targets in sorted(graph.items())
        if node != PACKAGE
        for target in sorted(targets)
        if target != PACKAGE and layer_of(target) > layer_of(node)
    ]


def test_packages_import_only_the_layers_below():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a higher layer (docs/modules.md):\n" + "\n".join(upward)


def test_an_upward_import_is_caught():
    graph = {
        "kvlab.specs.sizing": {"kvlab.engine.scheduler"},
        "kvlab.engine.scheduler": {"kvlab.specs.sizing"},
    }
    assert upward_imports(graph) == ["kvlab.specs.sizing -> kvlab.engine.scheduler"]
