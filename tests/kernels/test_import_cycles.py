"""No import cycle inside batchd.kernels: every `import` and `from ... import` of a kernels module
(imports inside functions included) is an edge, `from batchd.kernels.X import name` an edge to
batchd.kernels.X.name where that is a module, and the graph has no strongly connected component
of more than one module."""
from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
PACKAGE = "batchd.kernels"


def module_name(path: Path) -> str:
    parts = path.relative_to(KERNELS).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in KERNELS.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names]
            else:
                continue
            graph[name] |= {t for t in map(known, targets) if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_inside_kernels():
    graph = import_graph()
    assert "batchd.kernels.stream_linear" in graph["batchd.kernels.small_matmul.triton_kernel"]   # edges seen
    assert cycles(graph) == []
