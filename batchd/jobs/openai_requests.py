"""Request lines of the OpenAI Batch API and of vLLM's `run-batch`, read as batchd jobs.

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "..."}],
              "max_completion_tokens": 200, "temperature": 0}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/completions",
     "body": {"model": "gpt-3.5-turbo-instruct", "prompt": "...", "max_tokens": 64}}

The body's fields map onto batchd params (`BODY_TO_PARAM`). A field batchd does not run (n > 1,
penalties, logprobs, tools, images...) is that line's error, naming the field, unless it
holds the value that changes nothing (`NEUTRAL`: "n": 1, "frequency_penalty": 0, "stream":
false, ...); `null` is the same as leaving a field out. A field left out takes the batch's
default (`--max-new-tokens`, `--temperature`...): batchd's own default temperature is 0
(greedy), where OpenAI's is 1.

`model` is a name of the hosted API: `--model-alias gpt-4o-mini=NAME` maps it onto a batchd
model name; otherwise it is set aside (`requested_model`) and submit prints a note.
"""
from __future__ import annotations

import json
from typing import Any, Optional

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
LINE_KEYS = ("custom_id", "method", "url", "body")

# body field -> batchd param
BODY_TO_PARAM = {
    "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "stop": "stop", "seed": "seed",
    # vLLM's extensions of the same request
    "top_k": "top_k", "ignore_eos": "ignore_eos", "continue_final_message": "continue_final_message",
}
# fields accepted only with a value that changes nothing (the API's own defaults)
NEUTRAL: dict[str, tuple] = {
    "n": (1,), "stream": (False,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "suffix": ("",), "tools": ([],),
    "tool_choice": ("none",), "response_format": ({"type": "text"},), "modalities": (["text"],),
    # vLLM
    "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,), "skip_special_tokens": (True,),
    "stop_token_ids": ([],), "include_stop_str_in_output": (False,), "use_beam_search": (False,),
    "length_penalty": (1,), "spaces_between_special_tokens": (True,),
}
# fields that never change a job's output
IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls",
           "request_id", "priority", "add_generation_prompt")
CHAT_ROLE_ALIASES = {"developer": "system"}   # OpenAI's newer name for the system message
MESSAGE_KEYS = ("role", "content", "name")


class RequestLineError(ValueError):
    """This line cannot become a job; the message says what to change."""


def is_openai_request(obj: dict) -> bool:
    return "body" in obj or "url" in obj or "method" in obj


def job_fields(obj: dict) -> dict[str, Any]:
    """{prompt | messages, params, requested_model} from one request line; raises
    RequestLineError naming every field it cannot run."""
    unknown = sorted(set(obj) - set(LINE_KEYS))
    if unknown:
        raise RequestLineError(f"unknown key {', '.join(map(repr, unknown))} in a batch request line "
                               f"(keys: {', '.join(LINE_KEYS)})")
    if obj.get("method", "POST") != "POST":
        raise RequestLineError(f"method {obj['method']!r}: batch requests are POST")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestLineError('"body" must be a JSON object holding the request')
    url = obj.get("url") or (CHAT_URL if "messages" in body else COMPLETIONS_URL)
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise RequestLineError(f"url {url!r} is not supported: batchd runs {CHAT_URL} and {COMPLETIONS_URL}")
    given = {key: value for key, value in body.items() if value is not None}
    input_key = "messages" if url == CHAT_URL else "prompt"
    _check_fields(given, input_key)
    fields: dict[str, Any] = {"params": _params(given), "requested_model": given.get("model")}
    if url == CHAT_URL:
        fields["messages"] = _messages(given.get("messages"))
        fields["params"]["chat"] = True
    else:
        fields["prompt"] = _prompt(given.get("prompt"))
        fields["params"]["chat"] = False   # /v1/completions is the raw prompt, whatever the batch's --chat
        if given.get("continue_final_message"):
            raise RequestLineError("continue_final_message needs a chat request (messages)")
    if given.get("add_generation_prompt") is False and not given.get("continue_final_message"):
        raise RequestLineError("add_generation_prompt=false is only supported with continue_final_message=true")
    return fields


def _check_fields(given: dict[str, Any], input_key: str) -> None:
    known = {input_key, *BODY_TO_PARAM, *NEUTRAL, *IGNORED}
    unknown = sorted(set(given) - known)
    unsupported = [f"{key}={_show(given[key])}" for key in NEUTRAL
                   if key in given and not _neutral(given[key], NEUTRAL[key])]
    problems = []
    if unknown:
        problems.append(f"unknown body field {', '.join(map(repr, unknown))}")
    if unsupported:
        problems.append(f"unsupported body field {', '.join(unsupported)} (batchd generates one text choice, "
                        "without penalties, logprobs or tools)")
    if problems:
        raise RequestLineError("; ".join(problems) + ": remove them")
    if input_key not in given:
        raise RequestLineError(f'the body has no "{input_key}"')


def _neutral(value: Any, accepted: tuple) -> bool:
    """`value` is one of the accepted values, in JSON terms (true is not 1, 1.0 is 1)."""
    def same(a: Any, b: Any) -> bool:
        numbers = (int, float)
        if type(a) in numbers and type(b) in numbers:
            return a == b
        return type(a) is type(b) and a == b
    return any(same(value, one) for one in accepted)


def _show(value: Any) -> str:
    return json.dumps(value)[:40]


def _params(given: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if "max_tokens" in given and "max_completion_tokens" in given and given["max_tokens"] != given["max_completion_tokens"]:
        raise RequestLineError("max_tokens and max_completion_tokens differ: give one of them")
    for field, param in BODY_TO_PARAM.items():
        if field in given:
            params[param] = given[field]
    return params


def _prompt(prompt: Any) -> Any:
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if prompt and all(isinstance(p, int) for p in prompt):
            raise RequestLineError("prompt as token ids is not supported: give the text")
        raise RequestLineError("prompt must be one string (one job per line)")
    return prompt   # validated with every other job's prompt at submit


def _messages(messages: Any) -> Any:
    if not isinstance(messages, list):
        return messages   # validate_input says what it should be
    return [_message(message, i) for i, message in enumerate(messages)]


def _message(message: Any, i: int) -> Any:
    if not isinstance(message, dict):
        return message
    extra = sorted(key for key, value in message.items() if key not in MESSAGE_KEYS and value is not None)
    if extra:
        raise RequestLineError(f"messages[{i}]: {', '.join(map(repr, extra))} not supported "
                               "(batchd runs text conversations, without tool calls)")
    out = {key: message[key] for key in MESSAGE_KEYS if message.get(key) is not None}
    if isinstance(out.get("role"), str):
        out["role"] = CHAT_ROLE_ALIASES.get(out["role"], out["role"])
    content = message.get("content")
    if isinstance(content, list):
        out["content"] = _text_of_parts(content, i)
    return out


def _text_of_parts(parts: list, i: int) -> str:
    """Content given as parts ([{"type": "text", "text": ...}, ...]): their texts joined by
    newlines, as vLLM joins them; any other kind of part is refused."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestLineError(f"messages[{i}].content[{j}]: only text parts are supported "
                                   f"(got {kind or type(part).__name__!r})")
        texts.append(part["text"])
    return "\n".join(texts)


def resolve_model(requested: Optional[str], aliases: dict[str, str]) -> Optional[str]:
    """The batchd model name a request's `model` maps to, or None (it is set aside)."""
    return aliases.get(requested) if isinstance(requested, str) else None
