"""Embedded defaults: no URLs set, everything lives in the data folder. `batchd run` starts the
valkey broker, submits, works until the batch is done, prints results and stops the broker.
Also `batchd generate --json` (one prompt, no queue)."""
from __future__ import annotations

import hashlib
import json

import pytest
import redis

from batchd.embedded import EmbeddedBroker, running_broker_url
from tests.conftest import smollm2_gguf_path
from tests.service.conftest import batchd_cli, service_env


def test_embedded_broker_is_shared_persistent_and_stopped_by_its_owner(tmp_path):
    owner = EmbeddedBroker(tmp_path)
    url = owner.start()
    try:
        assert running_broker_url(tmp_path) == url
        guest = EmbeddedBroker(tmp_path)
        assert guest.start() == url and not guest.owned  # a second process reuses it
        redis.Redis.from_url(url).lpush("batchd.q", "1")
        guest.stop()  # not the owner: keeps running
        assert running_broker_url(tmp_path) == url
    finally:
        owner.stop()
    assert running_broker_url(tmp_path) is None
    again = EmbeddedBroker(tmp_path)
    try:
        assert redis.Redis.from_url(again.start()).llen("batchd.q") == 1  # append-only file kept the message
    finally:
        again.stop()


@pytest.mark.slow
def test_run_with_embedded_defaults_finishes_the_batch(tmp_path):
    env = service_env(f"sqlite:///{tmp_path / 'data' / 'batchd.db'}", None, tmp_path / "data", "batchd")
    del env["BATCHD_DATABASE_URL"]  # the default: <data dir>/batchd.db
    jobs = "\n".join(json.dumps({"custom_id": f"q{i}", "prompt": p})
                     for i, p in enumerate(["The capital of France is", "One, two, three,"]))
    out = batchd_cli(["run", "-", "--batch", "embedded", "--max-new-tokens", "4"], env, input=jobs.encode(),
                     timeout=300)
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stdout + stderr
    assert "Traceback" not in stderr
    assert "q0" in stdout and "q1" in stdout
    totals = stdout.splitlines()[-4:]   # the totals `batchd report` opens with
    assert totals[0] == "batch embedded: 2 jobs: succeeded 2" and totals[1].startswith("wall time ")
    assert "generated" in totals[2] and totals[3].endswith("documents/hour (2 succeeded)")
    assert (tmp_path / "data" / "batchd.db").exists()
    assert (tmp_path / "data" / "broker" / "appendonlydir").is_dir()
    assert running_broker_url(tmp_path / "data") is None  # `run` stopped the broker it started


@pytest.mark.slow
def test_generate_json_contract():
    out = batchd_cli(["generate", "--model", str(smollm2_gguf_path()), "--prompt", "The capital of France is",
                      "--max-new-tokens", "4", "--json"], service_env("sqlite://", None, smollm2_gguf_path().parent,
                                                                       "x"), timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    result = json.loads(out.stdout)
    assert {"text", "token_ids", "output_sha256", "prompt_tokens", "generated_tokens", "telemetry"} <= set(result)
    assert result["output_sha256"] == hashlib.sha256(result["text"].encode("utf-8")).hexdigest()
    assert len(result["token_ids"]) == result["generated_tokens"] == 4
    assert result["telemetry"]["decode_s"] > 0 and result["telemetry"]["device"] == "cpu"
    assert result["text"].startswith(" Paris")
