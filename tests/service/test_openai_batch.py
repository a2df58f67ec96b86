"""OpenAI Batch API and vLLM run-batch files, as those projects document them: each request
line becomes a job (a field batchd cannot run is that line's error, naming it), and
`batchd export --format openai` writes the API's output lines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from batchd.cli.main import main
from batchd.db.models import Batch, Job, JobStatus
from batchd.db.session import session_scope
from batchd.engine.runtime import Engine, EngineConfig
from batchd.jobs import lifecycle
from batchd.jobs.job_request import request_for_job
from batchd.jobs.inputs import read_inputs
from batchd.jobs.manage import cancel
from batchd.jobs.openai_export import FINISH_REASONS, openai_line
from batchd.jobs.runner import result_row
from batchd.jobs.submit import submit_jobs
from batchd.db.types import utcnow

DATA = Path(__file__).parent / "data"


def line(body: dict, url: str = "/v1/chat/completions", custom_id: str = "r") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def read_lines(tmp_path, *lines: str, aliases=None):
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return list(read_inputs([str(path)], model_aliases=aliases))


HELLO = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello world!"}]


def test_vllms_example_file_reads_as_it_is():
    jobs = list(read_inputs([str(DATA / "vllm_example_batch.jsonl")]))
    assert [(j.custom_id, j.error, j.model, j.requested_model) for j in jobs] == [
        ("request-1", None, None, "meta-llama/Meta-Llama-3-8B-Instruct"),
        ("request-2", None, None, "meta-llama/Meta-Llama-3-8B-Instruct")]
    assert jobs[0].messages == HELLO and jobs[0].params == {"max_new_tokens": 1000, "chat": True}


def test_openais_guide_and_reference_files_read_as_they_are():
    guide = list(read_inputs([str(DATA / "openai_chat_batch.jsonl")]))
    assert [(j.custom_id, j.error, j.params) for j in guide] == [
        ("request-1", None, {"max_new_tokens": 1000, "chat": True}),
        ("request-2", None, {"max_new_tokens": 1000, "chat": True})]
    assert guide[1].messages[0] == {"role": "system", "content": "You are an unhelpful assistant."}
    [reference] = read_inputs([str(DATA / "openai_reference_batch.jsonl")])
    assert (reference.error, reference.params, reference.requested_model) == (None, {"chat": True}, "gpt-4o-mini")
    [completion] = read_inputs([str(DATA / "openai_completions_batch.jsonl")])
    assert (completion.prompt, completion.messages, completion.params) == (
        "Say this is a test", None, {"max_new_tokens": 7, "temperature": 0, "chat": False})


def test_an_endpoint_batchd_does_not_run_is_that_lines_error():
    [embedding] = read_inputs([str(DATA / "vllm_embeddings_batch.jsonl")])
    assert embedding.custom_id == "request-1"
    assert embedding.error == ("url '/v1/embeddings' is not supported: batchd runs /v1/chat/completions "
                               "and /v1/completions")


@pytest.mark.parametrize("extra, named", [
    ({"n": 2}, "n=2"),
    ({"frequency_penalty": 0.5, "presence_penalty": 1}, "presence_penalty=1, frequency_penalty=0.5"),
    ({"logprobs": True, "top_logprobs": 3}, "logprobs=true, top_logprobs=3"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools=[{"),
    ({"response_format": {"type": "json_object"}}, 'response_format={"type": "json_object"}'),
    ({"stream": True}, "stream=true"),
    ({"reasoning_effort": "high", "colour": 1}, "unknown body field 'colour', 'reasoning_effort'"),
    ({"best_of": 3, "repetition_penalty": 1.2}, "best_of=3, repetition_penalty=1.2"),
], ids=["n", "penalties", "logprobs", "tools", "json-mode", "stream", "unknown", "vllm-extras"])
def test_a_field_batchd_cannot_run_is_named_in_that_lines_error(tmp_path, extra, named):
    good, bad = read_lines(tmp_path, line({"model": "m", "messages": HELLO}, custom_id="good"),
                           line({"model": "m", "messages": HELLO, **extra}, custom_id="bad"))
    assert good.error is None and bad.custom_id == "bad"
    assert named in bad.error and bad.error.endswith(": remove them"), bad.error


def test_fields_that_change_nothing_are_accepted(tmp_path):
    neutral = {"n": 1, "stream": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "logprobs": False, "response_format": {"type": "text"}, "user": "user-1234", "metadata": {"k": "v"},
               "store": False, "service_tier": "auto", "tools": None, "temperature": None, "seed": 7,
               "top_p": 0.9, "stop": ["\n\n"], "top_k": 20}
    [job] = read_lines(tmp_path, line({"model": "m", "messages": HELLO, **neutral}))
    assert job.error is None
    assert job.params == {"seed": 7, "top_p": 0.9, "stop": ["\n\n"], "top_k": 20, "chat": True}


def test_message_content_parts_and_the_developer_role(tmp_path):
    messages = [{"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    [job] = read_lines(tmp_path, line({"model": "m", "messages": messages}))
    assert job.messages == [{"role": "system", "content": "Answer in French."},
                            {"role": "user", "content": "Hello\nworld"}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    [refused] = read_lines(tmp_path, line({"model": "m", "messages": image}))
    assert refused.error == "messages[0].content[0]: only text parts are supported (got 'image_url')"
    tool_call = [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]
    [refused] = read_lines(tmp_path, line({"model": "m", "messages": tool_call}))
    assert refused.error.startswith("messages[1]: 'tool_calls' not supported")


def test_vllms_continue_final_message_and_the_token_fields(tmp_path):
    messages = HELLO + [{"role": "assistant", "content": "Hello to you"}]
    [job] = read_lines(tmp_path, line({"model": "m", "messages": messages, "add_generation_prompt": False,
                                       "continue_final_message": True, "max_tokens": 5,
                                       "max_completion_tokens": 5, "ignore_eos": True}))
    assert job.error is None
    assert job.params == {"max_new_tokens": 5, "ignore_eos": True, "continue_final_message": True, "chat": True}
    [differ] = read_lines(tmp_path, line({"model": "m", "messages": HELLO, "max_tokens": 5,
                                          "max_completion_tokens": 6}))
    assert differ.error == "max_tokens and max_completion_tokens differ: give one of them"


def test_model_names_map_through_aliases_or_are_set_aside(tmp_path):
    mapped, unmapped = read_lines(tmp_path, line({"model": "gpt-4o-mini", "messages": HELLO}, custom_id="a"),
                                  line({"model": "gpt-4o", "messages": HELLO}, custom_id="b"),
                                  aliases={"gpt-4o-mini": "smollm2-135m"})
    assert (mapped.model, mapped.requested_model) == ("smollm2-135m", None)
    assert (unmapped.model, unmapped.requested_model) == (None, "gpt-4o")


def test_an_openai_file_is_submitted_line_by_line(settings, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text((DATA / "vllm_example_batch.jsonl").read_text()
                    + line({"model": "gpt-4o-mini", "messages": HELLO, "n": 3}, custom_id="request-3") + "\n"
                    + (DATA / "vllm_embeddings_batch.jsonl").read_text().replace("request-1", "request-4"))
    report = submit_jobs(settings, "b", read_inputs([str(path)]), defaults={"temperature": 0})
    assert len(report.job_ids) == 2 and [c for c, _ in report.rejected] == ["request-3", "request-4"]
    assert report.ignored_models == {"meta-llama/Meta-Llama-3-8B-Instruct": 2}   # the lines that run
    with session_scope(settings.database_url) as session:
        jobs = {j.custom_id: j for j in session.scalars(select(Job))}
    assert jobs["request-1"].status == JobStatus.PENDING and jobs["request-1"].model == settings.model_name
    assert jobs["request-1"].params == {"temperature": 0, "max_new_tokens": 1000, "chat": True}
    assert "n=3" in jobs["request-3"].error_message and "/v1/embeddings" in jobs["request-4"].error_message


def test_the_cli_says_which_model_names_it_set_aside(database_url, tmp_path):
    result = CliRunner().invoke(main, ["submit", str(DATA / "vllm_example_batch.jsonl"), "--batch", "v",
                                       "--no-publish", "--model-alias", "gpt-4o=smollm2-135m"],
                                env={"BATCHD_DATABASE_URL": database_url, "BATCHD_DATA_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert ("note: body.model 'meta-llama/Meta-Llama-3-8B-Instruct' on 2 line(s) is not a batchd model name; "
            "those jobs run on smollm2-135m (map it with --model-alias meta-llama/Meta-Llama-3-8B-Instruct=NAME)"
            in result.stderr)
    bad_alias = CliRunner().invoke(main, ["submit", "-", "--model-alias", "gpt-4o"], input="x",
                                   env={"BATCHD_DATABASE_URL": database_url, "BATCHD_DATA_DIR": str(tmp_path)})
    assert bad_alias.exit_code == 2 and "write API_MODEL=NAME" in bad_alias.stderr


# ---- the output file ------------------------------------------------------------------------

def shape(value):
    """The keys of a JSON value, nested (values themselves ignored)."""
    if isinstance(value, dict):
        return {key: shape(child) for key, child in value.items()}
    if isinstance(value, list):
        return [shape(child) for child in value[:1]]
    return None


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> Engine:
    return Engine.load(str(smollm2_gguf), EngineConfig(device="cpu", max_context=1024))


def run_for_real(settings, engine, job_id: int) -> None:
    """What the worker does with a job, in this process: claim, build, generate, commit."""
    with session_scope(settings.database_url) as session:
        session.get(Job, job_id).status = JobStatus.QUEUED
    claimed = lifecycle.claim(settings.database_url, job_id, "w1", 60)
    started = utcnow()
    generated = engine.generate(request_for_job(settings, claimed))   # the claim reads params as text
    row = result_row(generated, queue_wait_s=0.0, worker_host="here", worker_id="w1", started_at=started,
                     finished_at=utcnow())
    assert lifecycle.complete(settings.database_url, job_id, "w1", row)


def test_export_openai_writes_the_apis_output_lines(settings, engine, tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join([
        line({"model": "gpt-4o-mini", "messages": HELLO, "max_tokens": 6}, custom_id="chat"),
        line({"model": "gpt-3.5-turbo-instruct", "prompt": "The capital of France is", "max_tokens": 3},
             url="/v1/completions", custom_id="text"),
        line({"model": "gpt-4o-mini", "messages": HELLO, "n": 2}, custom_id="rejected"),
        line({"model": "gpt-4o-mini", "messages": HELLO}, custom_id="cancelled"),
        line({"model": "gpt-4o-mini", "messages": HELLO}, custom_id="waiting")]) + "\n")
    report = submit_jobs(settings, "b", read_inputs([str(path)]))
    chat_id, text_id, cancelled_id, _ = report.job_ids
    run_for_real(settings, engine, chat_id)
    run_for_real(settings, engine, text_id)
    cancel(settings.database_url, job_ids=[cancelled_id])

    result = CliRunner().invoke(main, ["export", "--batch", "b", "--format", "openai"],
                                env={"BATCHD_DATABASE_URL": settings.database_url, "BATCHD_DATA_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("1 job(s) not finished yet are not in the file")
    lines = {json.loads(text)["custom_id"]: json.loads(text) for text in result.stdout.splitlines()}
    assert sorted(lines) == ["cancelled", "chat", "rejected", "text"]

    documented = json.loads((DATA / "openai_chat_batch_output.jsonl").read_text().splitlines()[0])
    assert shape(lines["chat"]) == shape(documented)   # what scripts written for the API read
    with session_scope(settings.database_url) as session:
        results = {job.custom_id: job.result for job in session.scalars(select(Job).join(Batch))}
    chat_body, text_body = lines["chat"]["response"]["body"], lines["text"]["response"]["body"]
    assert chat_body["object"] == "chat.completion" and lines["chat"]["response"]["status_code"] == 200
    assert chat_body["choices"][0]["message"] == {"role": "assistant", "content": results["chat"].output_text}
    assert chat_body["choices"][0]["finish_reason"] == FINISH_REASONS[results["chat"].finish_reason]
    assert chat_body["usage"] == {"prompt_tokens": results["chat"].prompt_tokens,
                                  "completion_tokens": results["chat"].generated_tokens,
                                  "total_tokens": results["chat"].prompt_tokens + results["chat"].generated_tokens}
    assert text_body["object"] == "text_completion" and text_body["choices"][0]["text"] == results["text"].output_text
    assert results["text"].finish_reason == "length" and text_body["choices"][0]["finish_reason"] == "length"
    assert chat_body["model"] == settings.model_name and chat_body["system_fingerprint"] == \
        results["chat"].target_sha256[:16]
    rejected = lines["rejected"]["response"]
    assert rejected["status_code"] == 400 and rejected["body"]["error"]["code"] == "bad_input"
    assert "n=2" in rejected["body"]["error"]["message"] and lines["rejected"]["error"] is None
    assert lines["cancelled"]["response"] is None and lines["cancelled"]["error"]["code"] == "batch_cancelled"


@pytest.mark.parametrize("ours, theirs", list(FINISH_REASONS.items()))
def test_finish_reasons_map_to_the_apis_names(ours, theirs):
    row = {"status": "succeeded", "job_id": 1, "custom_id": "c", "output_text": "x", "finish_reason": ours,
           "messages": None, "params": {"chat": False}, "succeeded_at": "2026-12-05T10:00:00+00:00",
           "model": "m", "prompt_tokens": 3, "generated_tokens": 1, "target_sha256": None}
    choice = openai_line(row)["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == theirs and choice["text"] == "x"


@pytest.mark.parametrize("kind, status_code", [("bad_input", 400), ("too_long", 400), ("oom", 500),
                                               ("model_error", 500), ("internal", 500), ("worker_lost", 500),
                                               ("timeout", 500)])
def test_failed_jobs_answer_with_the_apis_status_codes(kind, status_code):
    row = {"status": "failed", "job_id": 2, "custom_id": "c", "error_kind": kind, "error_message": "why"}
    response = openai_line(row)["response"]
    assert response["status_code"] == status_code and response["body"]["error"]["code"] == kind
