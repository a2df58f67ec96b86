"""When generation ends: EOS ids, stop strings and the token budget.

Stop strings are text, so the checker detokenises a sliding tail of the output; the final text is
cut before the first stop string by the runtime.
"""
from __future__ import annotations

from typing import Callable, Optional


class StopChecker:
    def __init__(self, eos_ids: set[int], max_new_tokens: int, stop_strings: tuple[str, ...] = (),
                 decode: Optional[Callable[[list[int]], str]] = None, ignore_eos: bool = False):
        self.eos_ids = set() if ignore_eos else set(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.decode = decode
        # enough tokens to contain any stop string (a token decodes to >= 1 char or a byte piece)
        self.tail_tokens = max((len(s.encode("utf-8")) for s in self.stop_strings), default=0) + 2

    def accept(self, generated: list[int], new_tokens: list[int]) -> Optional[str]:
        """Append `new_tokens` to `generated` one by one; return the finish reason
        ("eos", "stop", "length") as soon as one applies, or None to continue."""
        for token in new_tokens:
            if token in self.eos_ids:
                return "eos"
            generated.append(token)
            if self.stop_strings and self._hit_stop_string(generated):
                return "stop"
            if len(generated) >= self.max_new_tokens:
                return "length"
        return None

    def _hit_stop_string(self, generated: list[int]) -> bool:
        tail = self.decode(generated[-self.tail_tokens:])
        return any(s in tail for s in self.stop_strings)


def cut_at_stop_string(text: str, stop_strings: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop_strings if s and s in text]
    return text[: min(cuts)] if cuts else text
