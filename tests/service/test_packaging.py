"""An installed wheel runs the service, not only a checkout: the wheel carries the Alembic
migrations (setup.py installs migrations/ as batchd.migrations), and `batchd db upgrade` from the
installed copy brings a new database to the head revision. A wheel without the migrations fails
every command of an installed batchd on its schema check."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "batchd", "engine", "kernels", "migrations")

UPGRADE_FROM_INSTALLED = """
import sys
import batchd.db.migrate as migrate
from batchd.cli.main import main
assert migrate.__file__.startswith(sys.argv[1]), migrate.__file__      # the installed copy, not the checkout
sys.argv = ["batchd", "db", "upgrade"]
try:
    main()
except SystemExit as exit:
    assert not exit.code, exit.code
import os
db = os.environ["BATCHD_DATABASE_URL"]   # the database the command upgraded
print(migrate.migrations_dir(), migrate.current_revision(db), migrate.head_revision(db))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")   # --no-build-isolation builds with the environment's setuptools
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True)
    (built,) = out.glob("batchd-*.whl")
    return built


def test_wheel_carries_the_migrations(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    versions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("*.py"))
    assert versions
    expected = {"batchd/migrations/env.py", "batchd/migrations/script.py.mako",
                *(f"batchd/migrations/versions/{name}" for name in versions)}
    assert expected <= names, sorted(expected - names)


def test_installed_wheel_upgrades_a_new_database(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    url = f"sqlite:///{tmp_path / 'batchd.db'}"
    env = {**os.environ, "PYTHONPATH": str(target), "BATCHD_DATABASE_URL": url}
    result = subprocess.run([sys.executable, "-c", UPGRADE_FROM_INSTALLED, str(target)], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    migrations, current, head = result.stdout.split()[-3:]
    assert Path(migrations) == target / "batchd" / "migrations"
    assert current == head


def test_the_image_copies_what_the_build_reads():
    """scripts/docker/Dockerfile builds the same wheel: every source the build reads is copied in."""
    copied = set()
    for line in (ROOT / "scripts" / "docker" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(line.split()[1:-1])
    assert set(SOURCES) <= copied, sorted(set(SOURCES) - copied)


def test_the_wheel_installs_only_under_batchd(wheel):
    """engine/ and kernels/ ship as batchd.engine and batchd.kernels: nothing of ours named `engine`
    or `kernels` lands at the top of site-packages, where Hugging Face's `kernels` lives."""
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"batchd", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "batchd/engine/runtime.py" in names and "batchd/kernels/paged_attention/triton_kernel.py" in names
