"""The database and broker URLs as people write them: masked for printing, normalised for the
libraries, and read from files so that no password has to sit on a command line.

A URL carries its credentials in the userinfo (`postgresql://user:pass@host/db`,
`redis://:pass@host:6379/0`) or in a query parameter (`?password=...`, which libpq and redis-py
both read). `mask_url` hides both forms and is the one function that makes a URL printable;
`mask_secrets` does the same inside a message that may quote a URL or its password.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Optional
from urllib.parse import quote, unquote, unquote_plus

MASK = "***"
# Query parameters that carry a secret: libpq's password and sslpassword, redis-py's password,
# and the spellings people try.
SECRET_PARAMS = ("password", "pass", "passwd", "pwd", "sslpassword", "secret", "token", "auth")
# A value runs to the next `&name=`, not the next `&`: an unencoded `&` in a password stays hidden.
_SECRET_PARAM = re.compile(r"([?&;](?:%s)=)(.*?)(?=&[A-Za-z_][\w.-]*=|$)" % "|".join(SECRET_PARAMS),
                           re.IGNORECASE | re.DOTALL)
_QUERY_START = re.compile(r"\?[A-Za-z_][\w.-]*=")
REDIS_SCHEMES = ("redis", "rediss", "redis+socket", "valkey", "valkeys")


def mask_url(url: str) -> str:
    """`url` with every password replaced by ***: the userinfo's (everything between `://` and
    the last `@` when the URL is malformed, say an unencoded `@` in the password) and those of
    `?password=`-style parameters. The username, host, port, path and other parameters stay."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL: still hide anything before an @
        scheme, rest = "", url
    rest = _SECRET_PARAM.sub(lambda m: m.group(1) + MASK, rest)
    at = rest.rfind("@")
    if at >= 0:
        rest = _masked_userinfo(rest[:at]) + rest[at:]
    return f"{scheme}{sep}{rest}"


def _masked_userinfo(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    if not colon:  # a username alone is no secret, unless the text is too odd to tell
        return userinfo if "@" not in userinfo else MASK
    return f"{user}:{MASK}" if not re.search(r"[@/?#]", user) else MASK


def mask_secrets(text: str, urls: Iterable[Optional[str]]) -> str:
    """`text` (an error message) with each of `urls`, and each password in them, masked: a
    library's message may quote the URL, or a host name it misread from an unencoded `@`."""
    for url in filter(None, urls):
        text = text.replace(url, mask_url(url))
        for secret in sorted(_passwords(url), key=len, reverse=True):
            text = text.replace(secret, MASK)
            # a password misread as user@host leaves its tail in front of the host: `ss@host`
            for at in (i for i, c in enumerate(secret) if c == "@"):
                text = text.replace(secret[at + 1:] + "@", MASK + "@")
    return text


def _passwords(url: str) -> set[str]:
    scheme, sep, rest = url.partition("://")
    found = {m.group(2) for m in _SECRET_PARAM.finditer(rest)}
    at = _userinfo_end(rest) if sep else -1
    if at > 0:
        found.add(rest[:at].partition(":")[2])
    found |= {unquote(s) for s in found}
    return {s for s in found if s}


def _userinfo_end(rest: str) -> int:
    """Where the userinfo of `scheme://REST` ends (its last `@`), or -1 without one. An `@` in
    the query (`?application_name=a@b`) is not it; one in the password (`user:p@ss@host`) is."""
    if rest.startswith("/"):  # no authority: sqlite:///path, postgresql:///db?host=/run/postgresql
        return -1
    query = _QUERY_START.search(rest)
    return rest.rfind("@", 0, query.start() if query else len(rest))


def normalise_url(url: str, *, broker: bool = False) -> str:
    """The URL as SQLAlchemy, redis-py and kombu all read it: the userinfo percent-encoded, so
    an `@`, `/`, `?` or `#` in a password no longer ends it early (`%XX` escapes are kept), and
    for a Redis broker a `?password=` parameter moved into the userinfo (kombu cannot take it
    as a parameter: it fails with a TypeError). Raises ValueError for a password given twice."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    at = _userinfo_end(rest)
    user, colon, password = rest[:at].partition(":") if at >= 0 else ("", "", "")
    host_and_rest = rest[at + 1:] if at >= 0 else rest
    if broker and scheme.lower() in REDIS_SCHEMES:
        host_and_rest, from_query = _pop_query_param(host_and_rest, "password")
        if from_query is not None:
            if password:
                raise ValueError(f"broker URL {mask_url(url)} gives a password twice (user:password@ and "
                                 f"?password=); keep one")
            colon, password = ":", unquote_plus(from_query)   # a query value, as redis-py and kombu read it
            at = max(at, 0)
    if at < 0:
        return url
    userinfo = _encoded(user) + (colon + _encoded(password) if colon else "")
    return f"{scheme}{sep}{userinfo}@{host_and_rest}"


def _encoded(part: str) -> str:
    return quote(part, safe="%!$&'()*+,;=-._~")


def _pop_query_param(rest: str, name: str) -> tuple[str, Optional[str]]:
    """`rest` without the query parameter `name`, and its raw value (None when absent)."""
    base, question, query = rest.partition("?")
    if not question:
        return rest, None
    kept, value = [], None
    for item in query.split("&"):
        key, _, raw = item.partition("=")
        if key == name:
            value = raw
        else:
            kept.append(item)
    return (f"{base}?{'&'.join(kept)}" if kept else base), value


def read_url_file(path: str, setting: str) -> str:
    """The URL held in the file `path` (`--database-url-file`, BATCHD_DATABASE_URL_FILE, a Docker
    secret): its one line, without the trailing newline."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ValueError(f"{setting} {path}: cannot read it ({reason}); give a file that holds the URL") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        raise ValueError(f"{setting} {path}: holds {len(lines)} lines; give a file that holds the URL on one line")
    return lines[0]
