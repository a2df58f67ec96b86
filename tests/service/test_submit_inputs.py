"""Submitting on both databases: one bad line never costs the others their insert, a mistake
in the arguments leaves nothing behind, and a folder is the same jobs however its path is
typed (issues 36 and 38)."""
from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from sqlalchemy import select

from batchd.db.models import Batch, Job, JobEvent, JobStatus
from batchd.db.session import session_scope
from batchd.jobs.inputs import InputError, JobInput, read_inputs
from batchd.jobs.submit import submit_jobs
from batchd.engine.errors import BadInputError

GOOD = json.dumps({"custom_id": "good", "prompt": "fine"})
AFTER = json.dumps({"custom_id": "after", "messages": [{"role": "user", "content": "fine too"}]})


def jobs_by_custom_id(settings, batch="b") -> dict[str, Job]:
    with session_scope(settings.database_url) as session:
        rows = session.scalars(select(Job).join(Batch).where(Batch.name == batch)).all()
    return {job.custom_id: job for job in rows}


def batch_names(settings) -> list[str]:
    with session_scope(settings.database_url) as session:
        return list(session.scalars(select(Batch.name)))


@pytest.mark.parametrize("bad_line, message", [
    ('{"custom_id": "bad", "prompt": "x", "params": {"temperature": NaN}}', "NaN is not a JSON number"),
    ('{"custom_id": "bad", "prompt": "x", "params": {"temperature": Infinity}}', "Infinity is not a JSON number"),
    ('{"custom_id": "bad", "prompt": "x\\u0000y"}', "prompt contains a NUL character"),
    ('{"custom_id": "bad\\u0000", "prompt": "x"}', "custom_id contains a NUL character"),
    ('{"custom_id": "bad", "messages": [{"role": "user", "content": "\\u0000"}]}', "contains a NUL character"),
    ('{"custom_id": "bad", "prompt": "x\\ud800"}', "lone UTF-16 surrogate"),
    ('{"custom_id": "bad", "messages": [{"role": "user", "content": "\\udc80"}]}', "lone UTF-16 surrogate"),
    ('{"custom_id": "bad", "prompt": "x", "params": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),
    ('{"custom_id": "bad", "prompt": "x", "params": ' + '{"a":' * 50_000 + "1" + "}" * 50_000 + "}", "nested deeper"),
    ('{"custom_id": "bad", "messages": [{"role": "robot", "content": "hi"}]}', "is not a chat role"),
], ids=["nan", "infinity", "nul-prompt", "nul-custom-id", "nul-content", "surrogate-prompt", "surrogate-content",
        "nested-lists", "nested-objects", "unknown-role"])
def test_one_bad_line_is_its_own_failed_job_and_the_others_are_stored(settings, tmp_path, bad_line, message):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes("\n".join([GOOD, bad_line, AFTER]).encode("utf-8", "surrogatepass"))
    report = submit_jobs(settings, "b", read_inputs([str(path)]))
    assert len(report.job_ids) == 2 and len(report.rejected) == 1 and message in report.rejected[0][1]
    jobs = jobs_by_custom_id(settings)
    assert {c: j.status for c, j in jobs.items() if c in ("good", "after")} == {"good": JobStatus.PENDING,
                                                                                "after": JobStatus.PENDING}
    [bad] = [j for c, j in jobs.items() if c not in ("good", "after")]
    assert (bad.status, bad.error_kind) == (JobStatus.FAILED, "bad_input") and message in bad.error_message


def test_inputs_made_in_code_are_made_storable_too(settings):
    """A JobInput that never went through a JSON line (a test, a script) is checked the same way:
    the failed row keeps what can be stored of it."""
    jobs = [JobInput(custom_id="nul", source="t", prompt="a\x00b"),
            JobInput(custom_id="surrogate-id-\udc80", source="t", prompt="p"),
            JobInput(custom_id="nan", source="t", prompt="p", params={"top_p": float("nan"), "stop": ["\x00"]}),
            JobInput(custom_id="x" * 300, source="t", prompt="p"),
            JobInput(custom_id="fine", source="t", prompt="p")]
    report = submit_jobs(settings, "b", jobs)
    assert len(report.job_ids) == 1 and len(report.rejected) == 4
    stored = jobs_by_custom_id(settings)
    assert stored["nul"].prompt == "a\ufffdb" and "NUL character" in stored["nul"].error_message
    assert stored["surrogate-id-\ufffd"].error_message.startswith("custom_id contains a lone UTF-16 surrogate")
    assert stored["nan"].params == {} or "nan" not in json.dumps(stored["nan"].params).lower()
    assert any(len(c) == 255 for c in stored) and stored["fine"].status == JobStatus.PENDING


def test_a_batch_name_the_column_cannot_hold_is_refused_before_anything_is_written(settings):
    for name, words in [("n" * 300, "the batch name has 300 characters"), ("a\x00b", "NUL character"),
                        ("  ", "the batch name is empty"), ("bad\udcff", "lone UTF-16 surrogate")]:
        with pytest.raises(InputError, match=words):
            submit_jobs(settings, name, [JobInput(custom_id="x", source="t", prompt="p")])
    submit_jobs(settings, "n" * 255, [JobInput(custom_id="x", source="t", prompt="p")])
    assert batch_names(settings) == ["n" * 255]


def test_a_failed_argument_check_leaves_no_empty_batch(settings, tmp_path):
    (tmp_path / "a.txt").write_text("a document")
    with pytest.raises(InputError, match="no such file"):
        submit_jobs(settings, "b", read_inputs([str(tmp_path / "a.txt"), str(tmp_path / "missing.txt")]))
    with pytest.raises(InputError, match="no files match"):
        submit_jobs(settings, "b", read_inputs([str(tmp_path / "a.txt"), str(tmp_path / "*.none")]))
    with pytest.raises(BadInputError, match="max_new_tokens"):
        submit_jobs(settings, "b", read_inputs([str(tmp_path / "a.txt")]), defaults={"max_new_tokens": -1})
    with pytest.raises(BadInputError, match="not a model name"):
        submit_jobs(settings, "b", read_inputs([str(tmp_path / "a.txt")]), model="no spaces please")
    with pytest.raises(InputError, match="the inputs hold no jobs"):
        submit_jobs(settings, "b", [])
    assert batch_names(settings) == []


def test_a_folder_typed_two_ways_is_one_set_of_jobs(settings, tmp_path, monkeypatch):
    (tmp_path / "papers").mkdir()
    for name in ("one.txt", "two.txt"):
        (tmp_path / "papers" / name).write_text(f"the paper {name}")
    monkeypatch.chdir(tmp_path)
    first = submit_jobs(settings, "b", read_inputs(["papers"]))
    second = submit_jobs(settings, "b", read_inputs([str(tmp_path / "papers") + "/"]))
    assert (len(first.job_ids), len(second.job_ids), second.already_present) == (2, 0, 2)


def test_a_new_batch_and_its_jobs_commit_together(settings, monkeypatch):
    """The batch row is inserted in the jobs' transaction: when inserting the jobs fails (here:
    the database goes away mid-write), no empty batch is left."""
    from batchd.jobs import submit

    def database_gone(*args):
        raise sa.exc.OperationalError("INSERT INTO jobs", {}, Exception("server closed the connection"))
    monkeypatch.setattr(submit, "_insert_chunk", database_gone)
    with pytest.raises(sa.exc.OperationalError):
        submit_jobs(settings, "b", [JobInput(custom_id="x", source="t", prompt="p")])
    assert batch_names(settings) == []
    monkeypatch.undo()
    submit_jobs(settings, "b", [JobInput(custom_id="x", source="t", prompt="p")])
    with session_scope(settings.database_url) as session:
        events = session.scalars(select(JobEvent.event)).all()
    assert (events, batch_names(settings)) == (["submitted"], ["b"])
