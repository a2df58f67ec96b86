"""Cross-tokenizer PFlash: text is the bridge between the target's tokens and the drafter's.

    view = drafter_view(target_codec, drafter_codec, target_ids)      # what the drafter scores
    ids, info = target_ids_after(view, selection.spans, target_codec)  # what the target prefills

target ids -> text -> drafter ids -> (score, select) -> kept text -> target ids. Kept text is
cut from the original text at drafter-token boundaries (the tokenizer's character offsets), so
every kept piece is an exact substring of the prompt, in order. The final instruction (the
text of the prompt's last `instruction_tokens` target tokens) is re-appended whole when less
than `min_instruction_kept` of its characters survived. When both sides use the same tokenizer
the text detour is skipped and kept token ranges are taken directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from batchd.engine.text import TextCodec

INSTRUCTION_TOKENS = 96
MIN_INSTRUCTION_KEPT = 0.8


@dataclass
class DrafterView:
    """The prompt as the drafter sees it. `bounds[i]:bounds[i+1]` is the text drafter token i
    owns (the bounds partition the whole text); None when no text detour is needed."""

    ids: list[int]
    text: Optional[str]
    bounds: Optional[list[int]]
    instruction_start: int  # where the final instruction begins: a char (text) or token index

    @property
    def same_tokenizer(self) -> bool:
        return self.text is None


@dataclass
class BridgeInfo:
    drafter_tokens_kept: int
    instruction_kept: float  # fraction of the final instruction that the selection kept
    instruction_reappended: bool


def same_tokenizer(a: TextCodec, b: TextCodec) -> bool:
    if a is b or a.tokenizer is b.tokenizer:
        return True
    return a.vocab_size == b.vocab_size and a.fingerprint == b.fingerprint


def drafter_view(target: TextCodec, drafter: TextCodec, target_ids: list[int], *,
                 instruction_tokens: int = INSTRUCTION_TOKENS) -> DrafterView:
    instruction_tokens = min(instruction_tokens, len(target_ids))
    if same_tokenizer(target, drafter):
        return DrafterView(list(target_ids), None, None, len(target_ids) - instruction_tokens)
    text = target.decode(target_ids, skip_special_tokens=False)
    encoding = drafter.tokenizer.encode(text, add_special_tokens=True)
    return DrafterView(encoding.ids, text, token_bounds(encoding.offsets, len(text)),
                       instruction_start(target, target_ids, text, instruction_tokens))


def instruction_start(target: TextCodec, ids: list[int], text: str, instruction_tokens: int) -> int:
    """Where the text of the last `instruction_tokens` ids begins in `text` (the decode of ids)."""
    tail = target.decode(ids[len(ids) - instruction_tokens:], skip_special_tokens=False)
    if tail and text.endswith(tail):
        return len(text) - len(tail)
    # a character split across the boundary decodes differently on its own: compare prefixes
    head = target.decode(ids[: len(ids) - instruction_tokens], skip_special_tokens=False)
    return common_prefix_length(text, head)


def token_bounds(offsets: list[tuple[int, int]], text_length: int) -> list[int]:
    """Character bounds [n + 1] from a tokenizer's offsets: token i owns [bounds[i], bounds[i+1]).
    Starts (not ends) are used, so whitespace a tokenizer trims from offsets still belongs to a
    token; added special tokens (offset (0, 0)) own nothing."""
    bounds, last = [0], 0
    for start, _ in offsets[1:]:
        last = max(last, start)
        bounds.append(last)
    bounds.append(text_length)
    return bounds


def common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the longest equal prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def target_ids_after(view: DrafterView, spans: list[tuple[int, int]], target: TextCodec, original_ids: list[int],
                     *, min_instruction_kept: float = MIN_INSTRUCTION_KEPT) -> tuple[list[int], BridgeInfo]:
    """Kept drafter-token spans -> the target's effective prompt ids."""
    kept_tokens = sum(end - start for start, end in spans)
    if view.same_tokenizer:
        pieces = [(start, end) for start, end in spans]
        total, cut = len(original_ids), view.instruction_start
    else:
        pieces = [(view.bounds[start], view.bounds[end]) for start, end in spans]
        total, cut = len(view.text), view.instruction_start
    covered = sum(max(0, min(end, total) - max(start, cut)) for start, end in pieces)
    kept_fraction = covered / (total - cut) if total > cut else 1.0
    reappend = kept_fraction < min_instruction_kept
    if reappend:  # drop the instruction's scattered pieces and put all of it back, at the end
        pieces = [(start, min(end, cut)) for start, end in pieces if start < cut] + [(cut, total)]
    info = BridgeInfo(kept_tokens, kept_fraction, reappend)
    if view.same_tokenizer:
        return [t for start, end in pieces for t in original_ids[start:end]], info
    text = "".join(view.text[start:end] for start, end in pieces)
    ids = target.encode(text, add_special_tokens=False)
    bos = target.token_id(target.bos_token)
    if original_ids and original_ids[0] == bos and (not ids or ids[0] != bos):
        ids = [bos] + ids  # a BOS the encoder added must survive even when the head chunk did not
    return ids, info


def kept_text(view: DrafterView, spans: list[tuple[int, int]]) -> str:
    """The text the kept drafter spans cover (cross-tokenizer views only), for tests and logs."""
    return "".join(view.text[view.bounds[s]:view.bounds[e]] for s, e in spans)
