"""The package list, which pyproject.toml cannot express.

Everything batchd installs lives under one import name, `batchd`: the repository's engine/, kernels/
and migrations/ folders are installed as batchd.engine, batchd.kernels and batchd.migrations through
setuptools' package_dir mapping. The folders stay at the top of the repository (where users and the
docs find them), while nothing called `engine` or `kernels` lands in site-packages, so batchd installs
beside Hugging Face's `kernels` package (a dependency of current transformers). Editable installs map
the same way (setuptools' editable finder). Everything else is in pyproject.toml."""
from setuptools import find_namespace_packages, setup

# import prefix -> repository folder
MAPPED = {"batchd.engine": "engine", "batchd.kernels": "kernels", "batchd.migrations": "migrations"}


def mapped_packages(prefix: str, folder: str) -> list[str]:
    """`prefix` and its sub-packages: every folder below `folder` (migrations/versions has no __init__.py)."""
    return [prefix, *(f"{prefix}.{name}" for name in find_namespace_packages(folder, exclude=["*__pycache__*"]))]


setup(
    packages=[*find_namespace_packages(include=["batchd", "batchd.*"], exclude=["*__pycache__*"]),
              *(name for prefix, folder in MAPPED.items() for name in mapped_packages(prefix, folder))],
    package_dir=MAPPED,
)
