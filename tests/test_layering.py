"""The import graph of batchd: no circles inside the engine or the kernels, and the layers point one way.

    service (batchd/)  ->  engine (batchd.engine, engine/)  ->  kernels (batchd.kernels, kernels/)

The graph is read from the source with `ast` (nothing is imported), imports inside functions
included: an import moved into a function to dodge a circle is still a circle. A module's node
is its dotted name (`batchd.engine.pflash.window`; a package is its `__init__`). `from P import
name` is an edge to `P.name` when that is a module, else to `P`. A package's `__init__` may
import its own submodules; that is only a circle when one of them imports the package back.

Run as a script for the report: `python tests/test_layering.py`.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
# import prefix -> repository folder (setup.py's package_dir mapping)
FOLDERS = {"batchd.engine": ROOT / "engine", "batchd.kernels": ROOT / "kernels", "batchd": ROOT / "batchd"}
ENGINE, KERNELS = "batchd.engine", "batchd.kernels"


def _module_names() -> dict[str, Path]:
    modules = {}
    for prefix, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix, *parts])] = path
    return modules


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _layer(name: str) -> str:
    return "kernels" if _in(name, KERNELS) else "engine" if _in(name, ENGINE) else "service"


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (anywhere in its file)."""
    modules = _module_names()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] == "batchd":
                    resolved = resolve(target)
                    if resolved is not None and resolved != module:
                        edges.add(resolved)
    return graph


def cycles(graph: dict[str, set[str]], package: str) -> list[list[str]]:
    """The strongly connected components of more than one module among `package`'s modules
    (Tarjan), each sorted; edges leaving `package` are ignored."""
    nodes = sorted(n for n in graph if _in(n, package))
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if not _in(w, package):
                continue
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in nodes:
        if v not in index:
            visit(v)
    return found


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the layering: the service never imports the kernels (it asks the
    engine); the kernels import neither the engine nor the service; the engine never imports
    the service."""
    forbidden = {("service", "kernels"), ("kernels", "engine"), ("kernels", "service"), ("engine", "service")}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if (_layer(a), _layer(b)) in forbidden)


GRAPH = import_graph()


def test_the_graph_sees_the_packages():
    assert "batchd.engine.runtime" in GRAPH and "batchd.kernels.small_matmul" in GRAPH and "batchd.worker" in GRAPH
    assert "batchd.engine.model" in GRAPH["batchd.engine.runtime"]


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    graph = {"batchd.engine.a": {"batchd.engine.b"}, "batchd.engine.b": {"batchd.engine.c"},
             "batchd.engine.c": {"batchd.engine.a"}, "batchd.engine.d": {"batchd.engine.a"}}
    assert cycles(graph, ENGINE) == [["batchd.engine.a", "batchd.engine.b", "batchd.engine.c"]]


def test_no_import_cycle_inside_the_engine():
    assert cycles(GRAPH, ENGINE) == []


def test_no_import_cycle_inside_the_kernels():
    assert cycles(GRAPH, KERNELS) == []


def test_layers_point_one_way():
    assert layer_violations(GRAPH) == []


def test_the_cli_imports_no_engine_until_a_command_runs_one():
    """`batchd status`, `submit`, `export`... must not pay torch's import (seconds): only the
    commands that load a model (worker, run, generate) import the engine, inside the command."""
    import subprocess

    code = "import sys, batchd.cli.main; print(sorted(m for m in ('torch', 'triton', 'batchd.worker') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


if __name__ == "__main__":
    for package in (ENGINE, KERNELS):
        found = cycles(GRAPH, package)
        print(f"{package}: {len(found)} import cycle(s)")
        for component in found:
            print("   ", " <-> ".join(component))
    violations = layer_violations(GRAPH)
    print(f"layering: {len(violations)} violation(s)", *violations, sep="\n    ")
