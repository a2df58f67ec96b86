"""kernels/ stands alone: it never imports the service or the engine."""
from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_kernels_import_neither_batchd_nor_engine():
    offenders = []
    for path in KERNELS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names
                          if n.split(".")[0] == "batchd" and not n.startswith("batchd.kernels")]
    assert not offenders
