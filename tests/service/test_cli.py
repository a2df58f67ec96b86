"""The command line as a person meets it: submit from files, folders, globs and stdin; a
mistake gets one line starting with "Error:" and never a traceback."""
from __future__ import annotations

import json
import re

import pytest

from tests.service.conftest import batchd_cli, service_env


@pytest.fixture
def env(database_url, redis_url, queue_prefix, tmp_path):
    return service_env(database_url, redis_url, tmp_path / "data", queue_prefix)


def one_line_error(result) -> str:
    stderr = result.stderr.decode()
    assert result.returncode != 0
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), stderr
    return lines[0]


def test_submit_folder_glob_and_stdin_then_status_and_export(env, tmp_path, redis_client, queue_prefix):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("first document")
    (tmp_path / "docs" / "b.txt").write_text("second document")
    (tmp_path / "c.md").write_text("third document")
    out = batchd_cli(["submit", str(tmp_path / "docs"), str(tmp_path / "*.md"), "--batch", "mixed",
                      "--template", "Summarise:\n{document}", "--max-new-tokens", "8", "--chat"], env)
    assert out.returncode == 0, out.stderr.decode()
    assert "3 new job(s)" in out.stdout.decode() and "queued" in out.stdout.decode()
    assert redis_client.llen(f"{queue_prefix}.smollm2-135m") == 3
    stdin = json.dumps({"custom_id": "s1", "prompt": "from stdin", "params": {"seed": 7}}).encode()
    out = batchd_cli(["submit", "-", "--batch", "mixed"], env, input=stdin)
    assert out.returncode == 0, out.stderr.decode()

    status = batchd_cli(["status", "--batch", "mixed", "--no-watch"], env).stdout.decode()
    assert re.search(r"0/4 \| queued 4", status), status
    exported = batchd_cli(["export", "--batch", "mixed"], env).stdout.decode().splitlines()
    rows = [json.loads(line) for line in exported]
    assert [r["status"] for r in rows] == ["queued"] * 4
    csv_out = batchd_cli(["export", "--batch", "mixed", "--format", "csv"], env).stdout.decode()
    assert csv_out.splitlines()[0].startswith("custom_id,status,output_text,output_sha256")
    assert "mixed" in batchd_cli(["status"], env).stdout.decode()

    cancelled = batchd_cli(["cancel", "--batch", "mixed"], env)
    assert "cancelled 4 job(s)" in cancelled.stdout.decode()
    retried = batchd_cli(["retry", "--batch", "mixed", "--status", "cancelled"], env)
    assert "retrying 4 job(s); 4 queued now" in retried.stdout.decode(), retried.stderr.decode()


@pytest.mark.parametrize("args, words", [
    (["submit", "/no/such/file.txt", "--batch", "x"], "no such file or folder"),
    (["submit", "/tmp/*.no-such-ext", "--batch", "x"], "no files match"),
    (["submit", "-", "--batch", "x", "--max-new-tokens", "-3"], "max_new_tokens"),
    (["submit", "-", "--batch", "x", "--template", "no placeholder"], "{document}"),
    (["status", "--batch", "never-made"], "no batch named 'never-made'"),
    (["results", "--batch", "never-made"], "no batch named"),
    (["worker", "--model", "/models/missing.gguf"], "no checkpoint at /models/missing.gguf"),
    (["run", "-", "--model", "/models/missing.gguf"], "no checkpoint at /models/missing.gguf"),
    (["generate", "--model", "/models/missing.gguf", "--prompt", "hi"], "no checkpoint"),
    (["submit", "-", "--batch", "b" * 300], "the batch name has 300 characters; give one of at most 255"),
], ids=["missing-file", "empty-glob", "negative-tokens", "template", "status", "results", "worker-model",
        "run-model", "generate-model", "batch-name-300"])
def test_person_errors_are_one_line(env, args, words):
    assert words in one_line_error(batchd_cli(args, env, input=b"some text"))


def test_unreachable_database_is_one_line(tmp_path):
    env = service_env("postgresql://nobody@127.0.0.1:1/none", None, tmp_path, "x")
    assert "cannot use postgresql://nobody@127.0.0.1:1/none" in one_line_error(batchd_cli(["status"], env))


def test_every_input_rejected_exits_non_zero(env, tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    out = batchd_cli(["submit", str(tmp_path / "empty.txt"), "--batch", "bad"], env)
    assert out.returncode == 1 and "Traceback" not in out.stderr.decode()
    assert out.stderr.decode().splitlines() == [f"rejected {tmp_path / 'empty.txt'}: empty file: nothing to generate from",
                                                "Error: every input was rejected; nothing to run"]


def test_lines_no_database_stores_are_rejected_one_by_one(env, tmp_path):
    """Issue 38: each of these lines used to end `submit` with a traceback and insert nothing."""
    bad = ['{"custom_id": "nan", "prompt": "x", "params": {"temperature": NaN}}',
           '{"custom_id": "inf", "prompt": "x", "params": {"temperature": Infinity}}',
           '{"custom_id": "nul", "prompt": "x\\u0000"}',
           '{"custom_id": "surrogate", "prompt": "\\ud800"}',
           '{"custom_id": "deep", "prompt": "x", "params": ' + "[" * 100_000 + "]" * 100_000 + "}"]
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(['{"custom_id": "good", "prompt": "fine"}', *bad]).encode())
    out = batchd_cli(["submit", str(path), "--batch", "hostile", "--no-publish"], env)
    assert out.returncode == 0 and "Traceback" not in out.stderr.decode(), out.stderr.decode()
    assert out.stdout.decode().startswith("batch hostile: 1 new job(s), 5 rejected (failed: bad_input)")
    rejected = out.stderr.decode().splitlines()
    assert len(rejected) == 5   # each under its line, not under the custom_id it named
    assert all(line.startswith(f"rejected {path}:{n}: line {n}: ") for n, line in enumerate(rejected, start=2))


@pytest.mark.parametrize("metadata, args, words", [
    ({"general.alignment": 0}, [], "model_error: {path}: metadata general.alignment is 0, but it must be a power"),
    ({"llama.block_count": 10**9}, [], "model_error: {path}: metadata llama.block_count is 1000000000"),
    ({"tokenizer.chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}, ["--chat"],
     "model_error: {path}: metadata tokenizer.chat_template: the Jinja sandbox blocks the chat template"),
], ids=["alignment-0", "block-count-1e9", "sandboxed-template"])
def test_generate_with_a_hostile_checkpoint_is_one_line(tmp_path, metadata, args, words):
    """Issue 38: these gave a ZeroDivisionError traceback, a hang, a SecurityError traceback."""
    from tests.engine.test_checkpoint_builders import tiny_hf_model, tiny_tokenizer, write_gguf

    tokenizer = tiny_tokenizer()
    path = write_gguf(tmp_path / "bad.gguf", tiny_hf_model("llama", tokenizer.get_vocab_size()), tokenizer,
                      metadata=metadata)
    env = service_env(f"sqlite:///{tmp_path / 'unused.db'}", None, tmp_path / "data", "x")
    result = batchd_cli(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2", *args], env)
    assert one_line_error(result).startswith("Error: " + words.format(path=path))
