"""The CUDA sources the kernels compile at first use (NVRTC) must ship in the wheel: a kernel whose
.cu file is not in pyproject's package-data works from a checkout and fails on the first call of
an installed worker (cluster_attention.cu did, until stop 30)."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_cuda_source_under_kernels_is_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted(p for p in (ROOT / "kernels").rglob("*") if p.suffix in (".cu", ".cuh"))
    assert sources, "no CUDA sources found under kernels/"
    missing = []
    for source in sources:
        package = ".".join(("batchd", *source.parent.relative_to(ROOT).parts))   # kernels/ installs as batchd.kernels
        if not any(fnmatch.fnmatch(source.name, pattern) for pattern in package_data.get(package, [])):
            missing.append(str(source.relative_to(ROOT)))
    assert not missing, f"add these to [tool.setuptools.package-data] in pyproject.toml: {missing}"
