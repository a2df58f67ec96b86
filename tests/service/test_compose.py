"""docker-compose.yml is valid (Debian's docker-compose validates it without a Docker engine)
and holds what production needs: healthchecks, a one-shot migration first, GPU workers,
Flower only behind a profile, no way to start without passwords."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.service.conftest import REPO_ROOT

COMPOSE = shutil.which("docker-compose")
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="docker-compose is not installed "
                                "(apt-get install -y docker-compose; .ci/run installs it)")


# the file has no default passwords (test_compose_production.py): give the ones a .env would
PASSWORDS = {"POSTGRES_PASSWORD": "pgsecret", "REDIS_PASSWORD": "redissecret", "FLOWER_BASIC_AUTH": "admin:secret"}


def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in PASSWORDS}
    environment.update(PASSWORDS if env is None else env)
    return subprocess.run([COMPOSE, "-f", str(REPO_ROOT / "docker-compose.yml"), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, env=environment)


def test_compose_file_is_valid():
    result = compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_refuses_to_run_without_passwords():
    result = compose("config", "-q", env={})
    assert result.returncode != 0
    assert "_PASSWORD in .env (cp .env.example .env)" in result.stderr + result.stdout


def test_compose_services_profiles_and_gpu():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(compose("--profile", "monitoring", "config").stdout)
    services = config["services"]
    one_shots = {"migrate", "cli", "models"}   # cli and models: profiles of their own (docker compose run)
    assert set(services) == {"redis", "postgres", "relay", "worker", "flower"} | one_shots
    for name, service in services.items():
        if name not in one_shots:
            assert "test" in service["healthcheck"], name
    assert services["worker"]["healthcheck"]["test"] == ["CMD", "batchd", "health", "--worker"]
    assert services["cli"]["profiles"] == ["cli"] and services["models"]["profiles"] == ["setup"]
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
