"""The README's first commands, as a newcomer runs them: `make demo` ends by saying how to put
`batchd` on the PATH, and what it says works."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.service.conftest import REPO_ROOT


def test_make_demo_ends_with_how_to_put_batchd_on_the_path(tmp_path):
    venv = tmp_path / "venv"   # an installed venv (its stamp newer than pyproject.toml) whose python is a stub
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho demo ran\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".batchd-installed").touch()
    out = subprocess.run(["make", "-s", "demo", f"VENV={venv}"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "demo ran"
    assert f"  source {venv}/bin/activate" in out.stdout
    assert f'export PATH="$PWD/{venv}/bin:$PATH"' in out.stdout
    assert lines[-1] == "then, for example: batchd results --batch demo-aclsum"


def test_the_readme_hint_puts_batchd_on_the_path():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "`source .venv/bin/activate`" in readme.split("## Everyday use", 1)[0]
    venv = Path(sys.prefix)   # the venv these tests run in, as `make install` makes it
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PATH"] = "/usr/bin:/bin"
    found = subprocess.run(["bash", "-c", f"source {venv}/bin/activate && command -v batchd"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert found.stdout.strip() == str(venv / "bin" / "batchd"), found.stderr
