"""docker-compose.yml keeps production's promises, read with pyyaml (no Docker needed): no default
password anywhere, compose stops with a message when one is unset, PostgreSQL and Redis reach
the host only through the opt-in override, an input folder for submits, a models folder with
a step that fills it, Flower behind basic auth, and a worker healthcheck that asks the worker."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import smollm2_gguf_path
from tests.service.conftest import REPO_ROOT

COMPOSE = REPO_ROOT / "docker-compose.yml"
PORTS = REPO_ROOT / "docker-compose.ports.yml"
ENV_EXAMPLE = REPO_ROOT / ".env.example"
SECRETS = ("POSTGRES_PASSWORD", "REDIS_PASSWORD")
FILLED = {"POSTGRES_PASSWORD": "pgsecret1", "REDIS_PASSWORD": "redissecret2", "FLOWER_BASIC_AUTH": "admin:flowersecret3"}

VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|:\?|-|\?)(?P<arg>[^}]*))?\}")


class Unset(ValueError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable syntax: ${VAR}, ${VAR:-default}, ${VAR:?error}, $$ for a literal $."""
    def value(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name", "op", "arg")
        if env.get(name):
            return env[name]
        if op in (":?", "?"):
            raise Unset(f"{name}: {arg}")
        return arg if op in (":-", "-") else ""
    return VARIABLE.sub(value, text)


def compose_config(env: dict[str, str], *files) -> dict:
    """The merged services of these files (docker-compose.yml alone by default), as `docker compose
    config` would give them: an override file's keys replace a service's keys."""
    merged: dict = {}
    for path in files or (COMPOSE,):
        config = yaml.safe_load(interpolate(path.read_text(encoding="utf-8"), env))
        for name, service in config["services"].items():
            merged.setdefault(name, {}).update(service)
    return merged


def test_no_password_has_a_default():
    text = COMPOSE.read_text(encoding="utf-8")
    for secret in SECRETS:
        uses = re.findall(r"\$\{" + secret + r"([^}]*)\}", text)
        assert uses, secret
        assert all(use.startswith(":?") for use in uses), (secret, uses)
    assert not re.search(r"PASSWORD[^}\n]*:-[^}]", text)
    assert not re.search(r"FLOWER_BASIC_AUTH:-[^}]", text)   # empty, and refused at start


@pytest.mark.parametrize("missing", SECRETS)
def test_compose_stops_with_a_message_when_a_password_is_unset(missing):
    env = {k: v for k, v in FILLED.items() if k != missing}
    with pytest.raises(Unset, match=f"{missing}: set {missing} in .env"):
        compose_config(env)


def test_env_example_names_every_required_variable_and_holds_no_password():
    example = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                   if line and not line.startswith("#"))
    required = set(re.findall(r"\$\{([A-Z_]+):\?", COMPOSE.read_text()))
    assert required == set(SECRETS)
    assert required | {"FLOWER_BASIC_AUTH"} <= set(example)
    assert all(example[name] == "" for name in required | {"FLOWER_BASIC_AUTH"})


def test_database_and_redis_reach_the_host_only_with_the_override():
    services = compose_config(FILLED)
    assert "ports" not in services["postgres"] and "ports" not in services["redis"]
    opted_in = compose_config(FILLED, COMPOSE, PORTS)
    assert opted_in["postgres"]["ports"] == ["127.0.0.1:5432:5432"]
    assert opted_in["redis"]["ports"] == ["127.0.0.1:6379:6379"]
    assert opted_in["postgres"]["environment"]["POSTGRES_PASSWORD"] == "pgsecret1"   # the rest as it was


def test_urls_carry_the_passwords_from_the_environment():
    services = compose_config(FILLED)
    for name in ("migrate", "relay", "worker", "cli", "flower"):
        environment = services[name]["environment"]
        assert environment["BATCHD_DATABASE_URL"] == "postgresql://batchd:pgsecret1@postgres:5432/batchd", name
        assert environment["BATCHD_BROKER_URL"] == "redis://:redissecret2@redis:6379/0", name
    assert services["redis"]["command"][-1] == "redissecret2"


def test_the_worker_healthcheck_asks_the_worker_itself():
    worker = compose_config(FILLED)["worker"]
    assert worker["healthcheck"]["test"] == ["CMD", "batchd", "health", "--worker"]
    assert worker["environment"]["BATCHD_METRICS_PORT"]   # what `health --worker` reads
    assert worker["environment"]["BATCHD_BROKER_URL"].startswith("redis://")   # the anchor's settings kept


def test_submits_read_an_input_folder_and_models_have_a_filling_step():
    services = compose_config(FILLED)
    cli = services["cli"]
    assert cli["entrypoint"] == ["batchd"] and cli["profiles"] == ["cli"]
    assert "./input:/input:ro" in cli["volumes"]
    for name in ("worker", "relay", "cli"):
        assert any(v.endswith(":/models:ro") for v in services[name]["volumes"]), name
    models = services["models"]
    assert models["profiles"] == ["setup"] and "./models:/models" in models["volumes"]
    assert models["command"] == ["python", "/setup/fill_models.py"]
    assert "./scripts/docker:/setup:ro" in models["volumes"]
    assert (REPO_ROOT / "scripts/docker/fill_models.py").exists()


def test_flower_needs_basic_auth():
    flower = compose_config(FILLED)["flower"]
    assert flower["profiles"] == ["monitoring"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == "admin:flowersecret3"
    script = flower["command"][-1]
    assert script.startswith('test -n "$FLOWER_BASIC_AUTH" ||') and "exit 1" in script
    assert "FLOWER_BASIC_AUTH" in flower["healthcheck"]["test"][-1]   # the healthcheck logs in too
    without = compose_config({k: v for k, v in FILLED.items() if k != "FLOWER_BASIC_AUTH"})["flower"]
    refused = subprocess.run(["sh", "-c", without["command"][-1].replace("exec celery", "exec true celery")],
                             env={"FLOWER_BASIC_AUTH": ""}, capture_output=True, text=True)
    assert refused.returncode == 1 and "set FLOWER_BASIC_AUTH=user:password" in refused.stderr


def test_the_models_step_copies_the_default_model(tmp_path):
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/docker/fill_models.py")], capture_output=True,
                         text=True, timeout=120, env={"BATCHD_MODELS_DIR": str(tmp_path / "models"), "PATH": ""})
    assert out.returncode == 0, out.stderr
    copied = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert copied.read_bytes() == smollm2_gguf_path().read_bytes()
    again = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/docker/fill_models.py")], capture_output=True,
                           text=True, timeout=120, env={"BATCHD_MODELS_DIR": str(tmp_path / "models")})
    assert again.returncode == 0 and "is there already" in again.stdout


def test_the_readme_documents_the_opt_ins():
    production = (REPO_ROOT / "README.md").read_text(encoding="utf-8").split("## Production\n", 1)[1]
    production = production.split("\n## ", 1)[0]
    for words in ("cp .env.example .env", "docker-compose.ports.yml", "docker compose run --rm models",
                  "docker compose run --rm cli submit /input/", "FLOWER_BASIC_AUTH", "health --worker"):
        assert words in production, words
