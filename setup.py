"""The package list, which pyproject.toml cannot express: batchd, engine and kernels as found, plus the
repository's migrations/ folder installed as batchd.migrations, so that an installed wheel can run
`batchd db upgrade` (batchd.db.migrate.migrations_dir looks there first, then beside the checkout).
Everything else is in pyproject.toml."""
from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["batchd*", "engine*", "kernels*"]),
              "batchd.migrations", "batchd.migrations.versions"],
    package_dir={"batchd.migrations": "migrations"},
)
