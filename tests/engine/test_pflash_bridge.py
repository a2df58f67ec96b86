"""Cross-tokenizer PFlash: target ids -> text -> drafter ids -> kept text -> target ids, with
SmolLM2's tokenizer on one side and Llama 3's (another vocabulary) on the other."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from batchd.engine.pflash.bridge import drafter_view, kept_text, same_tokenizer, target_ids_after, token_bounds
from batchd.engine.pflash.selection import SelectionParams, chunk_spans, select_chunks
from batchd.engine.text import TextCodec
from tests.engine.test_pflash_helpers import llama3_tokenizer_json, long_paper_text, smollm2_folder

QUESTION = "\n\nQuestion: which datasets does the paper evaluate on, and what is the main result?"


@pytest.fixture(scope="module")
def smollm2_codec() -> TextCodec:
    folder = smollm2_folder()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return TextCodec(Tokenizer.from_file(str(folder / "tokenizer.json")), config["chat_template"],
                     config["bos_token"], config["eos_token"])


@pytest.fixture(scope="module")
def llama3_codec() -> TextCodec:
    return TextCodec(Tokenizer.from_str(llama3_tokenizer_json()), None, "<|begin_of_text|>", "<|end_of_text|>")


@pytest.fixture(scope="module")
def document() -> str:
    return " ".join(long_paper_text().split(" ")[:2500])


def chat_ids(codec: TextCodec, text: str) -> list[int]:
    return codec.encode_request(text, None, chat=True)


def test_tokenizers_differ(smollm2_codec, llama3_codec):
    assert not same_tokenizer(smollm2_codec, llama3_codec)
    assert smollm2_codec.vocab_size != llama3_codec.vocab_size


def test_drafter_tokens_partition_the_prompt_text(smollm2_codec, llama3_codec, document):
    ids = chat_ids(smollm2_codec, document + QUESTION)
    view = drafter_view(smollm2_codec, llama3_codec, ids)
    assert "<|im_start|>user" in view.text  # the target's special tokens cross as text
    b = view.bounds
    assert len(b) == len(view.ids) + 1 and b[0] == 0 and b[-1] == len(view.text)
    assert all(x <= y for x, y in zip(b, b[1:]))
    assert "".join(view.text[x:y] for x, y in zip(b, b[1:])) == view.text
    assert view.text[view.instruction_start:].endswith(QUESTION.strip()[-30:] + "<|im_end|>\n<|im_start|>assistant\n")


def test_kept_text_is_the_prompt_in_order(smollm2_codec, llama3_codec, document):
    target_ids = chat_ids(smollm2_codec, document + QUESTION)
    view = drafter_view(smollm2_codec, llama3_codec, target_ids)
    scores = torch.rand(len(view.ids), generator=torch.Generator().manual_seed(0))
    sel = select_chunks(view.ids, scores, SelectionParams(keep_ratio=0.2))
    text = kept_text(view, sel.spans)
    at = 0
    for start, end in sel.spans:  # every kept piece is found in the prompt after the previous one
        piece = view.text[view.bounds[start]:view.bounds[end]]
        found = view.text.find(piece, at)
        assert found >= at
        at = found + len(piece)
    ids, info = target_ids_after(view, sel.spans, smollm2_codec, target_ids)
    assert not info.instruction_reappended and info.drafter_tokens_kept == sel.kept_tokens
    assert smollm2_codec.decode(ids, skip_special_tokens=False) == text
    assert text.endswith(QUESTION.strip() + "<|im_end|>\n<|im_start|>assistant\n")
    assert 0.1 * len(target_ids) < len(ids) < 0.3 * len(target_ids)
    assert ids[:3] == target_ids[:3]  # <|im_start|> is a special token again, not text


def test_final_instruction_reappended_when_mostly_cut(smollm2_codec, llama3_codec, document):
    long_question = QUESTION + " Answer in three sentences and cite the section of each claim."
    target_ids = chat_ids(smollm2_codec, document + long_question)
    view = drafter_view(smollm2_codec, llama3_codec, target_ids)
    n = len(view.ids)
    spans = chunk_spans([0, 1, 2, (n - 1) // 32], n, 32)  # head + only the last (partial) chunk
    ids, info = target_ids_after(view, spans, smollm2_codec, target_ids)
    assert info.instruction_reappended and info.instruction_kept < 0.8
    text = smollm2_codec.decode(ids, skip_special_tokens=False)
    instruction = view.text[view.instruction_start:]
    assert text.endswith(instruction) and text.count(instruction[-40:]) == 1
    assert text.startswith(view.text[: view.bounds[3 * 32]])


def test_instruction_not_reappended_when_kept(smollm2_codec, llama3_codec, document):
    target_ids = chat_ids(smollm2_codec, document + QUESTION)
    view = drafter_view(smollm2_codec, llama3_codec, target_ids)
    n = len(view.ids)
    spans = chunk_spans(list(range((n - 1) // 32 - 6, (n - 1) // 32 + 1)), n, 32)
    ids, info = target_ids_after(view, spans, smollm2_codec, target_ids)
    assert not info.instruction_reappended and info.instruction_kept == 1.0


def test_target_bos_survives_a_dropped_head(smollm2_codec, llama3_codec, document):
    """Roles swapped: Llama 3 (which adds a BOS) as the target, SmolLM2 as the drafter."""
    bos = llama3_codec.token_id("<|begin_of_text|>")
    target_ids = [bos] + llama3_codec.encode(document + QUESTION)  # as a template that writes BOS
    view = drafter_view(llama3_codec, smollm2_codec, target_ids)
    n = len(view.ids)
    spans = chunk_spans(list(range(40, 50)) + [(n - 1) // 32 - 3, (n - 1) // 32 - 2, (n - 1) // 32 - 1,
                                               (n - 1) // 32], n, 32)
    ids, _ = target_ids_after(view, spans, llama3_codec, target_ids)
    assert ids[0] == target_ids[0] and ids.count(target_ids[0]) == 1


def test_same_tokenizer_takes_token_ranges(smollm2_codec, document):
    target_ids = chat_ids(smollm2_codec, document + QUESTION)
    view = drafter_view(smollm2_codec, smollm2_codec, target_ids)
    assert view.same_tokenizer and view.ids == target_ids
    spans = [(0, 64), (320, 352), (len(target_ids) - 200, len(target_ids))]
    ids, info = target_ids_after(view, spans, smollm2_codec, target_ids)
    assert ids == [t for s, e in spans for t in target_ids[s:e]]
    assert not info.instruction_reappended


def test_token_bounds_keep_trimmed_whitespace():
    # offsets that trim a token's leading space still leave the space to a neighbour
    assert token_bounds([(0, 0), (0, 5), (6, 11), (12, 13)], 13) == [0, 0, 6, 12, 13]
