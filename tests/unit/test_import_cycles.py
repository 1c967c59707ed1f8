"""No import cycle among trainfast's modules, counting the imports inside functions, and the loader never reaches
the tuner.

The imports are read from the source with `ast` (nothing is imported), at module level and in any function or
block. Each is resolved to a trainfast module: `from pkg.mod import name` is an edge to `pkg.mod`, or to
`pkg.mod.name` when that is a module; importing a package is an edge to its `__init__`. The parent packages a
dotted import also runs are not counted: every module would then depend on `trainfast/__init__.py`.
"""

from __future__ import annotations

import ast
import importlib.util
from collections import deque
from pathlib import Path

Edges = dict[str, dict[str, list[str]]]  # module -> imported module -> where ("path:line")


def _package_root() -> Path:
    spec = importlib.util.find_spec("trainfast")  # finds the package without running its __init__
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = ["trainfast", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module: `trainfast.loader.make.make_loader` -> `trainfast.loader.make`."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path | None = None) -> Edges:
    root = root or _package_root()
    mods = _modules(root)
    graph: Edges = {m: {} for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: list[tuple[str | None, int]] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [(_resolve(a.name, mods), node.lineno) for a in node.names
                            if a.name.split(".")[0] == "trainfast"]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: `from . import x`, `from ..loader import make`
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                if base.split(".")[0] != "trainfast":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append((sub if sub in mods else _resolve(base, mods), node.lineno))
        for target, line in targets:
            where = f"{path.relative_to(root.parent)}:{line}"
            if target is not None and target != module and where not in graph[module].get(target, []):
                graph[module].setdefault(target, []).append(where)
    return graph


def cycles(graph: Edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _shortest_cycle(graph: Edges, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, for a readable failure."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w not in inside:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    return component


def describe(graph: Edges, component: list[str]) -> str:
    inside = set(component)
    lines = [f"{len(component)} modules in a cycle: {', '.join(component)}",
             "  e.g. " + " -> ".join(_shortest_cycle(graph, component)), "  edges within it:"]
    for v in component:
        for w in sorted(set(graph[v]) & inside):
            lines.append(f"    {v} -> {w}   ({', '.join(graph[v][w])})")
    return "\n".join(lines)


def reachable(graph: Edges, start: str) -> dict[str, str]:
    """Every module `start` imports, directly or not, with the module that imports it on a shortest path."""
    seen: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w not in seen and w != start:
                seen[w] = v
                queue.append(w)
    return seen


def test_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among trainfast's modules:\n" + "\n".join(describe(graph, c) for c in found)


def test_the_loader_does_not_import_the_tuner() -> None:
    graph = import_graph()
    problems = []
    for module in sorted(m for m in graph if m == "trainfast.loader" or m.startswith("trainfast.loader.")):
        via = reachable(graph, module)
        for tuner in sorted(t for t in via if t == "trainfast.tune" or t.startswith("trainfast.tune.")):
            chain = [tuner]
            while chain[-1] != module:
                chain.append(via[chain[-1]])
            problems.append(" -> ".join(reversed(chain)))
    assert not problems, "the loader imports the tuner:\n  " + "\n  ".join(problems)


def test_the_analysis_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    root = tmp_path / "trainfast"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from . import a\n")
    (root / "sub" / "a.py").write_text("def f():\n    from trainfast.sub.b import g\n    return g\n")
    (root / "sub" / "b.py").write_text("from ..sub import a\nfrom trainfast import leaf\n")
    (root / "leaf.py").write_text("import os\n")
    graph = import_graph(root)
    assert set(graph["trainfast.sub.a"]) == {"trainfast.sub.b"}
    assert set(graph["trainfast.sub.b"]) == {"trainfast.sub.a", "trainfast.leaf"}
    assert cycles(graph) == [["trainfast.sub.a", "trainfast.sub.b"]]
    assert "trainfast.sub.a -> trainfast.sub.b -> trainfast.sub.a" in describe(graph, cycles(graph)[0])
    assert set(reachable(graph, "trainfast.sub")) == {"trainfast.sub.a", "trainfast.sub.b", "trainfast.leaf"}
