"""Issue 38, item 5: no password is printed in any form it is written in; a Redis password given
as `?password=` reaches Celery in a form kombu takes; a URL can come from a file, off the
command line. Against the real PostgreSQL and a real password-protected Redis."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis

from batchd.config import Settings
from batchd.db import migrate
from batchd.db.migrate import head_revision
from batchd.db.session import dispose_all
from batchd.urls import mask_secrets, mask_url, normalise_url, read_url_file
from tests.service.conftest import _make_database, batchd_cli, service_env

SECRET = "s3cr3t-t0ken"


# ---- masking ----------------------------------------------------------------------------------

@pytest.mark.parametrize("url, masked", [
    ("postgresql://user:s3cr3t-t0ken@host:5432/db", "postgresql://user:***@host:5432/db"),
    ("postgresql://user:s3cr3t@t0ken@host/db", "postgresql://user:***@host/db"),
    ("postgresql://user:s3/cr?3t#t0ken@host/db", "postgresql://user:***@host/db"),
    ("postgresql://host/db?password=s3cr3t-t0ken", "postgresql://host/db?password=***"),
    ("postgresql://host/db?sslmode=require&password=s3cr3t&t0ken&application_name=x",
     "postgresql://host/db?sslmode=require&password=***&application_name=x"),
    ("postgresql://host/db?password=s3cr3t@t0ken", "postgresql://host/db?password=***"),
    ("postgresql://u:a@host/db?password=s3cr3t@t0ken", "postgresql://u:***@host/db?password=***"),
    ("redis://:s3cr3t-t0ken@host:6379/0", "redis://:***@host:6379/0"),
    ("redis://:s3cr3t@t0ken@host:6379/0", "redis://:***@host:6379/0"),
    ("redis://host:6379/0?password=s3cr3t-t0ken", "redis://host:6379/0?password=***"),
    ("rediss://host:6379/0?ssl_cert_reqs=none&Pass=s3cr3t-t0ken", "rediss://host:6379/0?ssl_cert_reqs=none&Pass=***"),
    ("redis://default:s3cr3t-t0ken@host:6379/0?pwd=s3cr3t", "redis://default:***@host:6379/0?pwd=***"),
    ("postgres ql://u:s3cr3t@t0ken@host/db", "postgres ql://u:***@host/db"),   # malformed: up to the last @
    ("u:s3cr3t-t0ken@host", "u:***@host"),
    ("postgresql://nobody@127.0.0.1:1/none", "postgresql://nobody@127.0.0.1:1/none"),
    ("sqlite:///./batchd-data/batchd.db", "sqlite:///./batchd-data/batchd.db"),
], ids=lambda v: v if not v.startswith(("postgres", "redis", "u:", "sqlite")) else None)
def test_mask_url_hides_every_form_of_password(url, masked):
    assert mask_url(url) == masked
    for piece in ("s3cr3t", "t0ken"):
        assert piece not in mask_url(url)


def test_mask_secrets_hides_a_password_a_library_quotes_or_misreads():
    url = "postgresql://user:s3cr3t@t0ken@db.example/prod"
    message = f'could not translate host name "t0ken@db.example" to address; url was {url}'
    masked = mask_secrets(message, [url])
    assert "s3cr3t" not in masked and "t0ken" not in masked
    assert masked.startswith('could not translate host name "***@db.example"')


# ---- normalising ------------------------------------------------------------------------------

@pytest.mark.parametrize("url, normal", [
    ("redis://127.0.0.1:6379/0?password=a@b&health_check_interval=5",
     "redis://:a%40b@127.0.0.1:6379/0?health_check_interval=5"),
    ("redis://default@127.0.0.1:6379/0?password=pw", "redis://default:pw@127.0.0.1:6379/0"),
    ("redis://127.0.0.1:6379/0?password=a+b%26c", "redis://:a%20b&c@127.0.0.1:6379/0"),
    ("redis://:p@ss@127.0.0.1:6379/0", "redis://:p%40ss@127.0.0.1:6379/0"),
    ("redis://:p%40ss@127.0.0.1:6379/0", "redis://:p%40ss@127.0.0.1:6379/0"),    # already encoded: kept
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("postgresql://u:p@ss@h/db?options=-csearch_path%3Dx", "postgresql://u:p%40ss@h/db?options=-csearch_path%3Dx"),
    ("postgresql://u@h/db?application_name=a@b", "postgresql://u@h/db?application_name=a@b"),
    ("sqlite:////home/me@work/batchd.db", "sqlite:////home/me@work/batchd.db"),
])
def test_normalise_url(url, normal):
    assert normalise_url(url, broker=url.startswith("redis")) == normal


def test_a_redis_password_given_twice_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"redis://:\*\*\*@h:6379/0\?password=\*\*\* gives a password twice") as info:
        normalise_url("redis://:pw-1st@h:6379/0?password=pw-2nd", broker=True)
    assert "pw-1st" not in str(info.value) and "pw-2nd" not in str(info.value)


# ---- URLs from files ------------------------------------------------------------------------------

def test_urls_from_files(tmp_path):
    (tmp_path / "db").write_text(f"postgresql://u:{SECRET}@h/db\n")
    (tmp_path / "broker").write_text(f"redis://h:6379/0?password={SECRET}\n")
    settings = Settings.from_env(env={"BATCHD_DATABASE_URL_FILE": str(tmp_path / "db"),
                                      "BATCHD_BROKER_URL_FILE": str(tmp_path / "broker")})
    assert settings.database_url == f"postgresql://u:{SECRET}@h/db"
    assert settings.broker_url == f"redis://:{SECRET}@h:6379/0"
    assert SECRET not in str(settings.redacted())
    with pytest.raises(ValueError, match="give one of --database-url .* and --database-url-file"):
        Settings.from_env(env={"BATCHD_DATABASE_URL_FILE": str(tmp_path / "db")}, database_url="sqlite:///x.db")
    with pytest.raises(ValueError, match=r"--broker-url-file .*missing: cannot read it \(No such file"):
        Settings.from_env(env={"BATCHD_BROKER_URL_FILE": str(tmp_path / "missing")})
    (tmp_path / "two").write_text("sqlite:///a.db\nsqlite:///b.db\n")
    with pytest.raises(ValueError, match="holds 2 lines"):
        read_url_file(str(tmp_path / "two"), "--database-url-file")


@pytest.mark.parametrize("name, value, kind", [("MAX_JOBS", "many", "a whole number"),
                                               ("MAX_ATTEMPTS", "4.5", "a whole number"),
                                               ("LEASE_S", "soon", "a number")])
def test_a_number_setting_that_is_not_one_names_its_variable(name, value, kind):
    with pytest.raises(ValueError, match=f"BATCHD_{name} must be {kind}, got '{value}'"):
        Settings.from_env(env={f"BATCHD_{name}": value})


def test_every_option_that_can_carry_a_password_says_how_to_keep_it_off_the_command_line(tmp_path):
    help_text = " ".join(run_cli(["--help"], service_env("sqlite:///x.db", None, tmp_path, "x")).split())
    assert "--database-url-file" in help_text and "--broker-url-file" in help_text
    assert "shows in `ps` when given here: set BATCHD_DATABASE_URL, use --database-url-file" in help_text
    assert "PGPASSFILE" in help_text
    assert "shows in `ps` when given here: set BATCHD_BROKER_URL or use --broker-url-file" in help_text


# ---- against the real servers ------------------------------------------------------------------

@pytest.fixture
def postgres_url(request, tmp_path) -> str:
    url = _make_database("postgresql", tmp_path, request)
    migrate.upgrade(url)
    yield url
    dispose_all()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_with_password(tmp_path):
    """A private redis-server that wants a password (with an `@` in it); stopped by its own pid."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    port, password = _free_port(), f"{SECRET}@x"
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
                                "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield port, password
    client.close()
    process.terminate()
    process.wait(timeout=10)


def run_cli(args: list[str], env: dict[str, str]) -> str:
    """`batchd ARGS` in this process (the CLI's imports take seconds per subprocess here); what it
    printed, stdout and stderr together, with no password in it."""
    from click.testing import CliRunner

    from batchd.cli.main import main

    result = CliRunner().invoke(main, args, env={k: None for k in os.environ if k.startswith("BATCHD_")} | env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return _no_secret(result.output)


def assert_no_secret(result) -> str:
    return _no_secret(result.stdout.decode() + result.stderr.decode())


def _no_secret(out: str) -> str:
    for piece in (SECRET, "s3cr3t", "t0ken", "@x@"):
        assert piece not in out, out
    assert "Traceback" not in out, out
    return out


def test_health_masks_postgresql_passwords_in_the_query_and_with_an_unencoded_at(postgres_url, tmp_path):
    # the test server trusts 127.0.0.1, so it connects whatever the password; what is printed is the point
    query_form = f"{postgres_url}&password={SECRET}"
    scheme, rest = postgres_url.split("://", 1)
    user, host = rest.split("@", 1)
    at_form = f"{scheme}://{user}:{SECRET}@x@{host}"   # an unencoded @ in the password
    for url in (query_form, at_form):
        out = run_cli(["health"], service_env(url, None, tmp_path / "data", "x"))
        assert "database ok: postgresql://" in out and f"at revision {head_revision(postgres_url)}" in out
        assert ("password=***" in out) if url is query_form else (f"{user}:***@{host.split('?')[0]}" in out)
    url_file = tmp_path / "database-url"
    url_file.write_text(at_form + "\n")
    env = service_env("", None, tmp_path / "data", "x")
    del env["BATCHD_DATABASE_URL"]
    out = run_cli(["--database-url-file", str(url_file), "health"], env)
    assert "database ok:" in out


def test_unreachable_database_with_a_password_is_one_masked_line(tmp_path):
    env = service_env(f"postgresql://nobody:{SECRET}@x@127.0.0.1:1/none?password={SECRET}", None, tmp_path, "x")
    out = assert_no_secret(batchd_cli(["status"], env))
    assert out.strip() == ("Error: cannot use postgresql://nobody:***@127.0.0.1:1/none?password=***: connection to "
                           "server at \"127.0.0.1\", port 1 failed: Connection refused"), out


def test_health_with_a_redis_query_password(postgres_url, redis_with_password, tmp_path):
    port, password = redis_with_password
    for broker in (f"redis://127.0.0.1:{port}/0?password={password}", f"redis://:{password}@127.0.0.1:{port}/0"):
        out = run_cli(["health"], service_env(postgres_url, broker, tmp_path / "data", "x"))
        assert f"broker ok: redis://:***@127.0.0.1:{port}/0" in out
    wrong = run_cli(["health"], service_env(postgres_url, f"redis://127.0.0.1:{port}/0?password=wrong-{SECRET}",
                                            tmp_path / "data", "x"))
    assert f"Error: broker redis://:***@127.0.0.1:{port}/0 does not answer" in wrong


def test_celery_reaches_redis_with_a_query_password(redis_with_password, tmp_path):
    """The worker used to fail with kombu's TypeError on this URL although `health` said ok."""
    from batchd.queue.celery_app import configure
    from batchd.queue.tasks import TASK_NAME

    port, password = redis_with_password
    prefix = f"secret{uuid.uuid4().hex[:6]}"
    settings = Settings.from_env(env={}, broker_url=f"redis://127.0.0.1:{port}/0?password={password}",
                                 queue_prefix=prefix, data_dir=str(tmp_path), model_path="m.gguf")
    app = configure(settings, settings.broker_url)
    app.send_task(TASK_NAME, args=["1"], queue=settings.queue_name)
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    assert client.llen(settings.queue_name) == 1
    client.close()
    with app.connection_for_write() as connection:
        assert SECRET not in connection.as_uri()


@pytest.mark.slow
def test_a_worker_serves_jobs_through_a_redis_query_password(postgres_url, redis_with_password, tmp_path):
    """End to end: a real worker on `?password=` gets its job, and its log holds no password."""
    from tests.service.conftest import WorkerProcess, wait_for

    port, password = redis_with_password
    env = service_env(postgres_url, f"redis://127.0.0.1:{port}/0?password={password}", tmp_path / "data",
                      f"secret{uuid.uuid4().hex[:6]}")
    worker = WorkerProcess(env, tmp_path / "worker.log")
    try:
        submitted = batchd_cli(["submit", "-", "--batch", "secret", "--max-new-tokens", "1"], env, input=b"Hello")
        assert submitted.returncode == 0, submitted.stderr.decode()
        wait_for(lambda: _job_states(postgres_url) == ["succeeded"], 240, "the job to succeed", worker=worker)
    finally:
        worker.stop()
    _no_secret(worker.output())
    assert "Connected to redis://:**@127.0.0.1" in worker.output()


def _job_states(database_url: str) -> list[str]:
    import sqlalchemy as sa

    from batchd.db.session import db_engine

    with db_engine(database_url).connect() as connection:
        return list(connection.execute(sa.text("SELECT status FROM jobs")).scalars())
