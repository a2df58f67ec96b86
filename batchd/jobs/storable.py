"""What both databases can hold, checked before a row is written, so that one bad line never
costs a submission (issue 38).

PostgreSQL refuses a NUL character in text and in JSON strings, and the token `NaN`; no
driver can encode a lone UTF-16 surrogate (`"\\ud800"` in JSON, or a file name that is not
UTF-8) as UTF-8; and Python's JSON reader and writer recurse once per nesting level. So:

- `loads_line` reads one JSON line strictly: NaN and Infinity are refused (they are not JSON)
  and so is nesting deeper than `MAX_JSON_DEPTH`; the error names the line's problem.
- `json_problem` / `text_problem` say where a value holds something no database stores.
- `scrubbed` turns a value into one that can be stored (for a job that failed at submit,
  kept only to show what was sent).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

# A job's deepest legitimate value is an OpenAI message's content part: line -> body ->
# messages -> [i] -> content -> [j] -> text, 6 levels. 32 leaves room and stays far from
# Python's recursion limit.
MAX_JSON_DEPTH = 32
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


class UnstorableJson(ValueError):
    """A JSON line that parses in Python but is not portable JSON, or nests too deep."""


def _refuse_constant(name: str) -> Any:
    raise UnstorableJson(f"{name} is not a JSON number; give a finite number")


def loads_line(line: str) -> Any:
    """json.loads, but NaN/Infinity and deep nesting raise UnstorableJson (a one-line message),
    and malformed JSON raises json.JSONDecodeError as usual."""
    try:
        value = json.loads(line, parse_constant=_refuse_constant)
    except RecursionError:
        raise UnstorableJson(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    problem = json_problem(value)
    if problem:
        raise UnstorableJson(problem)
    return value


def text_problem(text: str) -> Optional[str]:
    """Why `text` cannot be stored (None: it can)."""
    if "\x00" in text:
        return "contains a NUL character (\\u0000): give text, not binary data"
    if LONE_SURROGATE.search(text):
        return "contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a character: give valid UTF-8 text"
    return None


def json_problem(value: Any, where: str = "") -> Optional[str]:
    """The first place in a JSON value that no database stores, as `path: problem`; None if
    there is none. Iterative, so a deep value cannot exhaust the stack."""
    stack = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"{path or 'the value'}: nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(item, str):
            problem = text_problem(item)
            if problem:
                return f"{path or 'the value'} {problem}"
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{path or 'the value'}: {item} is not a JSON number; give a finite number"
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                key_problem = text_problem(key) if isinstance(key, str) else None
                if key_problem:
                    return f"{path or 'the value'}: a key {key_problem}"
                stack.append((child, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(item, list):
            for i in reversed(range(len(item))):
                stack.append((item[i], f"{path}[{i}]", depth + 1))
    return None


def scrubbed_text(text: str) -> str:
    """`text` with NUL characters and lone surrogates replaced by U+FFFD."""
    return LONE_SURROGATE.sub(REPLACEMENT, text.replace("\x00", REPLACEMENT))


def too_deep(value: Any) -> bool:
    """Whether a JSON value nests deeper than MAX_JSON_DEPTH (iteratively)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return False


def scrubbed(value: Any) -> Any:
    """A storable copy of a JSON value (strings scrubbed, non-finite numbers as None), or None
    when it nests too deep to keep."""
    if json_problem(value) is None:
        return value
    if too_deep(value):
        return None
    return _scrub(value)


def _scrub(value: Any) -> Any:   # recursion is safe here: the depth is at most MAX_JSON_DEPTH
    if isinstance(value, str):
        return scrubbed_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {scrubbed_text(str(k)): _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value
