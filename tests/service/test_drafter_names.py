"""Job params cannot choose what a worker loads (issue 38, item 3), on SQLite and PostgreSQL:
submit takes drafter names, never paths; the worker maps a name to its own configured
checkpoint (`--drafter-checkpoint NAME=PATH`, and its model under its model name); an unknown
name is that job's bad_input and says nothing of the host's files."""
from __future__ import annotations

import json
import os

import pytest
import sqlalchemy as sa

from batchd.db.session import session_scope
from batchd.jobs.inputs import JobInput
from batchd.jobs.runner import JobRunner
from batchd.jobs.submit import submit_jobs
from tests.conftest import smollm2_gguf_path
from tests.service.test_lifecycle import EngineDouble, LoopDouble, job, make_queued, submit


class RecordingEngine(EngineDouble):
    """EngineDouble that keeps the requests it was given (what the worker resolved)."""

    def __init__(self):
        super().__init__()
        self.requests = []

    def generate(self, request):
        self.requests.append(request)
        return super().generate(request)


@pytest.mark.parametrize("key, value", [("drafter", "/etc/passwd"), ("drafter", "/no/such/drafter.gguf"),
                                        ("compress_drafter", "../models/qwen.gguf"),
                                        ("compress_drafter", "smollm2-135m#layers=6")])
def test_submit_refuses_paths_and_a_compress_drafter_with_layers(settings, key, value):
    params = {key: value, "spec": "draft"} if key == "drafter" else {key: value, "compress": "always"}
    report = submit_jobs(settings, "b", [JobInput(custom_id="x", source="t", prompt="p", params=params)])
    [(_, message)] = report.rejected
    assert f"param {key}={value!r}" in message and "no checkpoint" not in message


def test_submit_takes_the_layers_suffix_of_a_named_drafter(settings):
    params = {"spec": "draft", "drafter": "smollm2-135m#layers=6"}
    report = submit_jobs(settings, "b", [JobInput(custom_id="x", source="t", prompt="p", params=params)])
    assert len(report.job_ids) == 1 and not report.rejected


def test_the_worker_maps_names_to_its_own_checkpoints(settings, tmp_path):
    spelled = f"{smollm2_gguf_path().parent}/./{smollm2_gguf_path().name}"
    worker_settings = settings.replace(drafters=(("smol-again", spelled),))
    ids = submit(settings, 2, params={"compress": "always", "compress_drafter": "smol-again"})
    with session_scope(settings.database_url) as session:   # a job written by SQL names the target's layers
        session.execute(sa.text("UPDATE jobs SET params = :p WHERE id = :id"),
                        {"p": '{"spec": "draft", "drafter": "smollm2-135m#layers=6"}', "id": ids[1]})
    make_queued(settings, ids)
    engine = RecordingEngine()
    runner = JobRunner(worker_settings, LoopDouble(engine), "w1")
    assert [runner.run(job_id) for job_id in ids] == ["succeeded", "succeeded"]
    real = os.path.realpath(smollm2_gguf_path())
    assert engine.requests[0].compression.drafter_path == real   # the configured file, however spelled
    assert engine.requests[1].speculation.drafter_path == f"{real}#layers=6"


@pytest.mark.parametrize("params", [{"spec": "draft", "drafter": "passwd"},
                                    {"compress": "always", "compress_drafter": "id_rsa"},
                                    {"spec": "draft", "drafter": "/etc/passwd"}])
def test_an_unknown_drafter_fails_that_job_and_names_no_file(settings, params):
    ids = submit(settings, 2)
    with session_scope(settings.database_url) as session:   # past submit's checks: written by SQL
        session.execute(sa.text("UPDATE jobs SET params = :p WHERE id = :id"),
                        {"p": json.dumps(params), "id": ids[0]})
    make_queued(settings, ids)
    engine = RecordingEngine()
    runner = JobRunner(settings.replace(drafters=(("tiny", str(smollm2_gguf_path())),)), LoopDouble(engine), "w1")
    assert [runner.run(job_id) for job_id in ids] == ["failed", "succeeded"]
    failed = job(settings, ids[0])
    assert failed.error_kind == "bad_input" and len(engine.requests) == 1
    assert "/" not in failed.error_message.replace(params.get("drafter", ""), "")
    assert str(smollm2_gguf_path().parent) not in failed.error_message
