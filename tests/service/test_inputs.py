"""Reading what a person submits, and checking each job's params: bad ones are named, per job."""
from __future__ import annotations

import io
import json

import pytest

from batchd.jobs.inputs import InputError, read_inputs
from batchd.jobs.params import build_request, validate_input, validate_params
from batchd.engine.errors import BadInputError


def write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_files_folders_and_globs_become_one_job_each(tmp_path):
    write(tmp_path / "docs" / "a.txt", b"alpha")
    write(tmp_path / "docs" / "sub" / "b.md", b"beta")
    write(tmp_path / "docs" / ".hidden", b"skip me")
    write(tmp_path / "c.txt", b"gamma")
    jobs = list(read_inputs([str(tmp_path / "docs"), str(tmp_path / "c*.txt")], template="Summarise: {document}"))
    assert [j.prompt for j in jobs] == ["Summarise: alpha", "Summarise: beta", "Summarise: gamma"]
    assert all(j.error is None for j in jobs)
    assert len({j.custom_id for j in jobs}) == 3


def test_stdin_text_and_stdin_jsonl():
    [doc] = read_inputs(["-"], stdin=io.BytesIO(b"just a document"))
    assert doc.prompt == "just a document" and doc.custom_id == "stdin"
    lines = b'{"custom_id": "x", "prompt": "p"}\n\n{"custom_id": "y", "messages": [{"role": "user", "content": "m"}]}\n'
    jobs = list(read_inputs(["-"], stdin=io.BytesIO(lines)))
    assert [(j.custom_id, j.prompt, j.messages) for j in jobs] == [
        ("x", "p", None), ("y", None, [{"role": "user", "content": "m"}])]


@pytest.mark.parametrize("data, message", [
    (b"", "empty file"),
    (b"  \n\t", "empty file"),
    (b"PK\x03\x04\x00\x00binary", "binary file"),
    (b"caf\xe9 au lait", "not valid UTF-8"),
], ids=["empty", "whitespace", "binary", "latin1"])
def test_unusable_document_is_a_per_job_error(tmp_path, data, message):
    [job] = read_inputs([str(write(tmp_path / "doc.txt", data))])
    assert job.error is not None and message in job.error


def test_bad_jsonl_lines_are_errors_and_the_rest_are_jobs(tmp_path):
    lines = [json.dumps({"custom_id": "ok", "prompt": "fine"}), "{not json", json.dumps([1, 2]),
             json.dumps({"custom_id": "extra", "prompt": "p", "colour": "red"}),
             json.dumps({"custom_id": "p", "prompt": "p", "params": "hot"})]
    jobs = list(read_inputs([str(write(tmp_path / "jobs.jsonl", "\n".join(lines).encode()))]))
    assert [j.error is None for j in jobs] == [True, False, False, False, False]
    assert "line 2: not valid JSON" in jobs[1].error
    assert "unknown key 'colour'" in jobs[3].error


def test_missing_path_and_empty_glob_stop_the_submit(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        list(read_inputs([str(tmp_path / "nope.txt")]))
    with pytest.raises(InputError, match="no files match"):
        list(read_inputs([str(tmp_path / "*.none")]))


@pytest.mark.parametrize("params, message", [
    ({"max_new_tokens": -5}, "max_new_tokens"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 5}, "unknown param 'max_tokens'"),
    ({"max_new_tokens": "ten"}, "max_new_tokens"),
    ({"spec": "magic"}, "spec"),
    ({"spec": "draft"}, "needs a drafter"),
    ({"drafter": "/no/such/drafter.gguf", "spec": "draft"}, "not a drafter name"),
    ({"keep_ratio": 0}, "keep_ratio"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_invalid_params_name_the_problem(params, message):
    with pytest.raises(BadInputError, match=message):
        validate_params(params)


@pytest.mark.parametrize("prompt, messages", [(None, None), ("a", [{"role": "user", "content": "b"}]), ("   ", None),
                                              (None, []), (None, [{"role": "user"}]), (5, None)])
def test_invalid_prompt_or_messages(prompt, messages):
    with pytest.raises(BadInputError):
        validate_input(prompt, messages)


def test_params_become_the_engine_request():
    request = build_request(None, [{"role": "user", "content": "hi"}],
                            {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": "END",
                             "spec": "lookup", "compress": "auto", "keep_ratio": 0.2, "chat": True})
    assert request.sampling.max_new_tokens == 12 and request.sampling.temperature == 0.7
    assert request.sampling.stop == ("END",) and request.sampling.seed == 3
    assert request.speculation.method == "lookup" and request.compression.mode == "auto"
    assert request.compression.keep_ratio == 0.2 and request.chat
