"""Reading what a person submits, and checking each job's params: bad ones are named, per job."""
from __future__ import annotations

import io
import json
import os
import re

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


def lines_file(tmp_path, *lines: str, name="jobs.jsonl", prefix: bytes = b""):
    return str(write(tmp_path / name, prefix + "\n".join(lines).encode("utf-8", "surrogatepass")))


GOOD_LINE = json.dumps({"custom_id": "good", "prompt": "fine"})


@pytest.mark.parametrize("bad_line, message", [
    ('{"custom_id": "a", "prompt": "x", "params": {"temperature": NaN}}', "NaN is not a JSON number"),
    ('{"custom_id": "a", "prompt": "x", "params": {"top_p": Infinity}}', "Infinity is not a JSON number"),
    ('{"custom_id": "a", "prompt": "x", "params": {"temperature": -Infinity}}', "-Infinity is not a JSON number"),
    ('{"custom_id": "a", "prompt": "x\\u0000y"}', "prompt contains a NUL character"),
    ('{"custom_id": "a\\u0000", "prompt": "x"}', "custom_id contains a NUL character"),
    ('{"custom_id": "a", "messages": [{"role": "user", "content": "x\\u0000"}]}',
     "messages[0].content contains a NUL character"),
    ('{"custom_id": "a", "prompt": "x\\ud800"}', "prompt contains a lone UTF-16 surrogate"),
    ('{"custom_id": "a", "prompt": "x", "params": {"stop": ["\\udfff"]}}', "params.stop[0] contains a lone UTF-16"),
    ('{"custom_id": "a", "prompt": "x", "params": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than"),
    ('{"custom_id": "a", "prompt": "x", "params": {"stop": ' + "[" * 40 + "]" * 40 + "}}", "nested deeper than 32"),
], ids=["nan", "infinity", "minus-infinity", "nul-prompt", "nul-custom-id", "nul-content", "surrogate-prompt",
        "surrogate-stop", "nesting-100000", "nesting-40"])
def test_a_line_no_database_stores_is_that_lines_error(tmp_path, bad_line, message):
    good, bad, after = read_inputs([lines_file(tmp_path, GOOD_LINE, bad_line, GOOD_LINE.replace("good", "after"))])
    assert (good.custom_id, good.error, after.custom_id, after.error) == ("good", None, "after", None)
    assert bad.error is not None and message in bad.error, bad.error
    assert bad.custom_id == f"{tmp_path / 'jobs.jsonl'}:2" and bad.prompt is None and bad.params == {}


def test_a_utf8_byte_order_mark_reads_like_none(tmp_path):
    plain = list(read_inputs([lines_file(tmp_path, GOOD_LINE, name="plain.jsonl")]))
    bom = list(read_inputs([lines_file(tmp_path, GOOD_LINE, name="bom.jsonl", prefix=b"\xef\xbb\xbf")]))
    assert [(j.custom_id, j.prompt, j.error) for j in bom] == [(j.custom_id, j.prompt, j.error) for j in plain]
    [stdin_job] = read_inputs(["-"], stdin=io.BytesIO(b"\xef\xbb\xbf" + GOOD_LINE.encode()))
    assert (stdin_job.custom_id, stdin_job.prompt) == ("good", "fine")
    [document] = read_inputs([str(write(tmp_path / "doc.txt", b"\xef\xbb\xbfBonjour"))], template="S: {document}")
    assert document.prompt == "S: Bonjour"
    [only_bom] = read_inputs([str(write(tmp_path / "empty.txt", b"\xef\xbb\xbf\n"))])
    assert "empty file" in only_bom.error


def test_a_folders_custom_ids_do_not_depend_on_how_its_path_is_typed(tmp_path, monkeypatch):
    write(tmp_path / "docs" / "a.txt", b"alpha")
    write(tmp_path / "docs" / "sub" / "b.txt", b"beta")
    (tmp_path / "link").symlink_to(tmp_path / "docs")
    monkeypatch.chdir(tmp_path)
    spellings = ["docs", "./docs/", "docs//", str(tmp_path / "docs"), f"{tmp_path}/./sub/../docs", "link",
                 "docs/sub/../"]
    (tmp_path / "sub").mkdir()
    ids = {spelling: [j.custom_id for j in read_inputs([spelling])] for spelling in spellings}
    expected = [str((tmp_path / "docs" / "a.txt").resolve()), str((tmp_path / "docs" / "sub" / "b.txt").resolve())]
    assert ids == {spelling: expected for spelling in spellings}
    [by_glob] = read_inputs(["./docs/*.txt"])
    [by_file] = read_inputs([str(tmp_path / "docs" / "." / "a.txt")])
    assert by_glob.custom_id == by_file.custom_id == expected[0]


def test_a_file_name_that_is_not_utf8_gives_a_storable_custom_id(tmp_path):
    folder = tmp_path / "names"
    folder.mkdir()
    (folder / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"coffee")
    [job] = read_inputs([str(folder)])
    assert job.custom_id == f"{folder.resolve()}/caf\\xe9.txt" and job.error is None
    job.custom_id.encode("utf-8")  # no lone surrogate left


def test_a_custom_id_past_the_column_width_is_shortened_stably(tmp_path):
    deep = tmp_path / "/".join(["d" * 60] * 5)
    write(deep / "doc.txt", b"text")
    [first] = read_inputs([str(deep)])
    [again] = read_inputs([str(deep / "doc.txt")])
    assert len(first.custom_id) == 255 and first.custom_id.endswith("/doc.txt") and first.custom_id == again.custom_id


@pytest.mark.parametrize("messages, message", [
    ([{"role": "bot", "content": "hi"}], "messages[0].role 'bot' is not a chat role: use system, user or assistant"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}], "messages[1].role 'tool'"),
    ([{"role": "User", "content": "hi"}], "messages[0].role 'User'"),
], ids=["bot", "tool", "capitalised"])
def test_unknown_chat_roles_are_refused(messages, message):
    with pytest.raises(BadInputError, match=re.escape(message)):
        validate_input(None, messages)
    with pytest.raises(BadInputError, match=re.escape(message)):
        build_request(None, messages, {})  # the worker checks rows written by SQL the same way


def test_continue_final_message_needs_messages_to_continue():
    request = build_request(None, [{"role": "user", "content": "Name a colour."},
                                   {"role": "assistant", "content": "The colour is"}],
                            {"continue_final_message": True})
    assert request.continue_final_message and not build_request("p", None, {}).continue_final_message
    with pytest.raises(BadInputError, match="continue_final_message needs messages"):
        build_request("a prompt", None, {"continue_final_message": True, "chat": True})
    with pytest.raises(BadInputError, match="the last message is empty"):
        build_request(None, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
                      {"continue_final_message": True})
