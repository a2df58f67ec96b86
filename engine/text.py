"""Text in and out of the token-id core: encoding, chat templates, decoding.

Chat templates are the checkpoint's own Jinja templates (tokenizer_config.json or GGUF metadata),
rendered the way transformers renders them, so prompts match the reference implementation, in
Jinja's sandbox: a template that reaches for Python internals is the checkpoint's fault (a
`model_error` naming where the template came from); one that calls `raise_exception` refuses the
job's messages (`bad_input`).
"""
from __future__ import annotations

import functools
import hashlib
from datetime import datetime
from typing import Optional, Union

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from batchd.engine.errors import BadInputError, CheckpointError, EngineError
from batchd.engine.whole_chars import TokenBytes, decode_whole_chars


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, chat_template: Optional[str] = None,
                 bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                 template_source: Optional[str] = None):
        """template_source: where the template came from ("FILE: FIELD"), for its errors."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.template_source = template_source or "the checkpoint's chat template"
        self._template = _compile_template(chat_template, self.template_source) if chat_template else None

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the tokenizer's whole definition: equal for the same tokenizer loaded twice
        (serialising it takes ~25 ms for a 150K vocabulary, so once per codec)."""
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_whole_chars(self, ids: list[int]) -> tuple[str, int]:
        """`decode` up to the last whole character, and the bytes of an unfinished one held back
        after it (engine.whole_chars)."""
        return decode_whole_chars(ids, self.decode, self._token_bytes)

    @functools.cached_property
    def _token_bytes(self) -> TokenBytes:
        return TokenBytes(self.tokenizer)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The chat template over `messages`. `continue_final_message`: the text ends inside the
        last message, right after its content (no end-of-turn, no new turn), so generation
        continues it."""
        if self._template is None:
            raise BadInputError("this checkpoint has no chat template; submit a plain prompt (no --chat)")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise BadInputError('each chat message must be {"role": ..., "content": "<text>"}')
        text = self._render(messages=messages,
                            add_generation_prompt=add_generation_prompt and not continue_final_message,
                            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return _cut_after_final_message(text, messages[-1]["content"]) if continue_final_message else text

    def _render(self, **context) -> str:
        try:
            return self._template.render(**context)
        except TemplateRefusal as err:
            raise BadInputError(f"the chat template refuses these messages: {_one_line(err)}") from None
        except jinja2.sandbox.SecurityError as err:
            raise CheckpointError(f"{self.template_source}: the Jinja sandbox blocks the chat template "
                                  f"({_one_line(err)}); use a checkpoint whose template only formats messages, "
                                  f"or submit plain prompts (no --chat)") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as err:
            raise CheckpointError(f"{self.template_source}: the chat template fails "
                                  f"({type(err).__name__}: {_one_line(err)}); fix the template, or submit plain "
                                  f"prompts (no --chat)") from None

    def encode_request(self, prompt: Optional[str], messages: Optional[list[dict]], chat: bool,
                       continue_final_message: bool = False) -> list[int]:
        """Prompt ids for a job: a plain prompt, or the chat template over messages (a plain
        prompt with chat=True becomes one user message)."""
        text, special = self._request_text(prompt, messages, chat, continue_final_message)
        return _checked_prompt(self.encode(text, add_special_tokens=special))

    def encode_requests(self, requests) -> list[Union[list[int], EngineError]]:
        """`encode_request` for many jobs (GenerationRequests) at once: each one's ids, or the
        EngineError that stops that job alone. The templates render one by one; the texts are
        tokenized by one `encode_batch` per special-token setting, which runs on the tokenizer's
        own threads (a 4K-token document is milliseconds of single-threaded work, and a worker
        that takes 64 documents at once would otherwise hold its GPU idle for that long)."""
        out: list = [None] * len(requests)
        texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        for i, r in enumerate(requests):
            try:
                text, special = self._request_text(r.prompt, r.messages, r.chat, r.continue_final_message)
            except Exception as exc:  # noqa: BLE001 - this job's error, as encode_request would raise it
                out[i] = exc
                continue
            texts[special].append((i, text))
        for special, items in texts.items():
            if not items:
                continue
            try:
                ids = [e.ids for e in self.tokenizer.encode_batch([t for _, t in items], add_special_tokens=special)]
            except Exception:  # noqa: BLE001 - one text the tokenizer refuses: find it, the rest go on
                ids = [self._ids_or_error(t, special) for _, t in items]
            for (i, _), job_ids in zip(items, ids):
                try:
                    out[i] = job_ids if isinstance(job_ids, Exception) else _checked_prompt(job_ids)
                except EngineError as exc:
                    out[i] = exc
        return out

    def _ids_or_error(self, text: str, special: bool):
        try:
            return self.encode(text, add_special_tokens=special)
        except Exception as exc:  # noqa: BLE001
            return exc

    def _request_text(self, prompt: Optional[str], messages: Optional[list[dict]], chat: bool,
                      continue_final_message: bool) -> tuple[str, bool]:
        """-> (the text to tokenize, whether the tokenizer adds its special tokens)."""
        if (prompt is None) == (messages is None):
            raise BadInputError("give exactly one of prompt and messages")
        if messages is not None or chat:
            text = self.render_chat(messages if messages is not None else [{"role": "user", "content": prompt}],
                                    continue_final_message=continue_final_message)
            return text, False   # the template already wrote any BOS token; do not add another
        return prompt, True


def _checked_prompt(ids: list[int]) -> list[int]:
    if not ids:
        raise BadInputError("the prompt is empty; give some text to generate from")
    return ids


def _cut_after_final_message(text: str, final: str) -> str:
    """The rendered chat up to the end of the last message's content: transformers'
    `continue_final_message` rule, including its care for whitespace a template trims."""
    if not final.strip() or final.strip() not in text:
        raise BadInputError("continue_final_message: the chat template does not reproduce the last message's text, "
                            "so it cannot be continued; submit it without continue_final_message")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final:
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]   # the template trimmed the message's trailing spaces


class TemplateRefusal(jinja2.TemplateError):
    """The template's own `raise_exception(...)`: it refuses the messages it was given."""


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300]


def _compile_template(template: str, source: str) -> jinja2.Template:
    def raise_exception(message):
        raise TemplateRefusal(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise CheckpointError(f"{source}: the chat template is not valid Jinja (line {err.lineno}: "
                              f"{_one_line(err.message or err)}); fix the template") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
