"""docker-compose.yml is valid (Debian's docker-compose validates it without a Docker engine)
and holds what production needs: healthchecks, a one-shot migration first, GPU workers,
Flower only behind a profile."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.service.conftest import REPO_ROOT

COMPOSE = shutil.which("docker-compose")
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="docker-compose is not installed "
                                "(apt-get install -y docker-compose; .ci/run installs it)")


def compose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([COMPOSE, "-f", str(REPO_ROOT / "docker-compose.yml"), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_compose_file_is_valid():
    result = compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_services_profiles_and_gpu():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(compose("--profile", "monitoring", "config").stdout)
    services = config["services"]
    assert set(services) == {"redis", "postgres", "migrate", "relay", "worker", "flower"}
    for name, service in services.items():
        if name != "migrate":
            assert "test" in service["healthcheck"], name
    for name in ("relay", "worker", "flower"):
        assert services[name]["restart"] == "unless-stopped"
    for name in ("relay", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["environment"]["BATCHD_BROKER_URL"].startswith("redis://")
        assert services[name]["environment"]["BATCHD_DATABASE_URL"].startswith("postgresql://")
    assert services["migrate"]["command"] == ["batchd", "db", "upgrade"]
    [gpu] = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["capabilities"] == ["gpu"] and gpu["count"] == 1
    assert services["flower"]["profiles"] == ["monitoring"]
