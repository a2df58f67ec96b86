"""Output text that ends on a whole character.

A token budget, an end-of-sequence token or a stop can end generation inside a multi-byte UTF-8
character: an emoji is 4 bytes, often 2 tokens. Decoded as it is, that tail becomes U+FFFD and
the output's SHA-256 covers a character the model never finished. `decode_whole_chars` holds
the incomplete tail back: the text ends with the last whole character, and the bytes held back
are counted (`Telemetry.output_dropped_bytes`). Held back means: the tail is a valid beginning of
a character that more bytes would have completed. A U+FFFD the model wrote (bytes EF BF BD),
and bytes that no continuation could make valid, stay in the text as they are.

Which bytes a token stands for depends on the tokenizer's decoder. Byte-level BPE (GPT-2, Llama 3,
Qwen, SmolLM2) maps each byte to a printable character; SentencePiece with byte fallback writes
the bytes it has no piece for as '<0xAB>' tokens. Other decoders (plain Metaspace, WordPiece)
cannot produce a partial character, and nothing is held back.
"""
from __future__ import annotations

import codecs
import functools
import json
import re
from typing import Callable, Optional

from tokenizers import Tokenizer

from batchd.engine.stopping import cut_at_stop_string

MAX_CHAR_BYTES = 4
TAIL_TOKENS = 8   # tokens looked at from the end: enough for 4 bytes when some are special (empty)
BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character that stands for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenBytes:
    """The bytes each token id stands for, for byte-level and byte-fallback decoders; `kind` is
    None for a decoder that cannot end inside a character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.kind = decoder_kind(tokenizer)
        self.special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}

    def __call__(self, token_id: int) -> bytes:
        """What `token_id` adds to the output's bytes (special tokens add nothing: they are skipped)."""
        token = self.tokenizer.id_to_token(token_id)
        if token is None or token_id in self.special:
            return b""
        if self.kind == "byte_level":
            alphabet = byte_level_alphabet()
            if all(ch in alphabet for ch in token):
                return bytes(alphabet[ch] for ch in token)
            return token.encode("utf-8")   # an added token: its content as written
        byte = BYTE_TOKEN.match(token)
        return bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode("utf-8")


def decoder_kind(tokenizer: Tokenizer) -> Optional[str]:
    """'byte_level', 'byte_fallback' or None, from the decoder's own definition."""
    decoder = tokenizer.decoder
    if decoder is None:
        return None
    spec = json.loads(decoder.__getstate__())
    types = {d.get("type") for d in spec.get("decoders", [])} | {spec.get("type")}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types:
        return "byte_fallback"
    return None


def incomplete_tail_bytes(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character without finishing it (0..3)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data[-MAX_CHAR_BYTES:], final=False)
    pending, _ = decoder.getstate()
    return len(pending)


def decode_whole_chars(ids: list[int], decode: Callable[[list[int]], str],
                       token_bytes: TokenBytes) -> tuple[str, int]:
    """(the text of `ids` up to its last whole character, the bytes held back after it).

    Only the tokens that carry the incomplete tail are decoded apart: the rest goes through the
    tokenizer's own `decode`, so every output that ends on a whole character is exactly what
    `decode(ids)` gives."""
    text = decode(ids)
    if token_bytes.kind is None or not text.endswith("\ufffd"):
        return text, 0
    tail = [token_bytes(i) for i in ids[-TAIL_TOKENS:]]
    held = incomplete_tail_bytes(b"".join(tail))
    if held == 0:
        return text, 0   # a U+FFFD of the model's own, or bytes that can never be valid
    # the fewest trailing tokens that hold the incomplete bytes and start on a character boundary
    count, carried = 0, b""
    while count < len(tail):
        count += 1
        carried = tail[-count] + carried
        if len(carried) >= held and carried[:1] and not 0x80 <= carried[0] <= 0xBF:
            break
    head = decode(ids[:-count]) if count < len(ids) else ""
    return head + carried[:-held].decode("utf-8", errors="replace"), held


def output_text(codec, ids: list[int], stop_strings: tuple[str, ...]) -> tuple[str, int]:
    """A job's final text: whole characters only, cut before the first stop string; and the
    bytes held back (0 when a stop string cut the text: the tail went with it)."""
    text, held = codec.decode_whole_chars(ids)
    cut = cut_at_stop_string(text, stop_strings)
    return cut, (held if cut == text else 0)
