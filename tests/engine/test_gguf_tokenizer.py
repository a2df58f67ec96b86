"""Tokenizers rebuilt from GGUF metadata split text the way llama.cpp does for each `tokenizer.ggml.pre`,
and agree with transformers' own GGUF tokenizer conversion where that one is faithful."""
from __future__ import annotations

import pytest

from batchd.engine.checkpoint import load_checkpoint
from batchd.engine.checkpoint.gguf_tokenizer import build_tokenizer
from tests.engine.test_checkpoint_builders import TEXT, tiny_hf_model, tiny_tokenizer, tokenizer_metadata, write_gguf

SAMPLES = [
    TEXT,
    "In 2024 we ran 1234567 steps.\n\n1. First\r\n2. Second\n",
    "They're here, we'll see; I'd've said it's OK!!  \t  done",
    "naïve café — 東京 ٣٤٥",
    "<|im_start|>user\nhello<|im_end|>\n",
]


@pytest.fixture(scope="module")
def metadata():
    tok = tiny_tokenizer()
    meta = tokenizer_metadata(tok)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": meta["tokens"],
            "tokenizer.ggml.merges": meta["merges"], "tokenizer.ggml.token_type": meta["types"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def pieces(metadata: dict, pre: str, text: str) -> list[str]:
    tokenizer = build_tokenizer(dict(metadata, **{"tokenizer.ggml.pre": pre}))
    return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_llama3_splits_numbers_in_threes(metadata):
    assert pieces(metadata, "llama-bpe", "x 1234567") == ["x", "Ġ", "123", "456", "7"]


def test_qwen2_splits_every_digit(metadata):
    assert pieces(metadata, "qwen2", "x 1234") == ["x", "Ġ", "1", "2", "3", "4"]


def test_smollm_splits_every_digit_and_keeps_gpt2_words(metadata):
    assert pieces(metadata, "smollm", "don't 42") == ["don", "'t", "Ġ", "4", "2"]


def test_gpt2_keeps_number_runs(metadata):
    assert pieces(metadata, "gpt-2", "x 1234") == ["x", "Ġ1234"]


def test_qwen2_normalises_to_nfc(metadata):
    tokenizer = build_tokenizer(dict(metadata, **{"tokenizer.ggml.pre": "qwen2"}))
    assert tokenizer.encode("cafe\u0301").ids == tokenizer.encode("caf\u00e9").ids


def test_bos_is_added_when_the_file_says_so(metadata):
    plain = build_tokenizer(dict(metadata, **{"tokenizer.ggml.pre": "gpt-2"}))
    with_bos = build_tokenizer(dict(metadata, **{"tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("hello").ids == [1] + plain.encode("hello").ids
    assert with_bos.encode("hello", add_special_tokens=False).ids == plain.encode("hello").ids
    # llama.cpp adds BOS for Llama 3 vocabularies when the flag is absent
    llama3 = build_tokenizer(dict(metadata, **{"tokenizer.ggml.pre": "llama-bpe"}))
    assert llama3.encode("hello").ids[0] == 1


def test_control_tokens_are_special_and_skipped_in_decode(metadata):
    tokenizer = build_tokenizer(dict(metadata, **{"tokenizer.ggml.pre": "gpt-2"}))
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_user_defined_tokens_are_matched_whole(metadata):
    meta = dict(metadata, **{"tokenizer.ggml.pre": "qwen2"})
    meta["tokenizer.ggml.tokens"] = metadata["tokenizer.ggml.tokens"] + ["<think>"]
    meta["tokenizer.ggml.token_type"] = metadata["tokenizer.ggml.token_type"] + [4]
    tokenizer = build_tokenizer(meta)
    think = len(metadata["tokenizer.ggml.tokens"])
    assert think in tokenizer.encode("a<think>b").ids
    assert tokenizer.decode(tokenizer.encode("a<think>b").ids) == "a<think>b"  # not special: kept


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_matches_transformers_gguf_tokenizer(tmp_path, pre):
    convert = pytest.importorskip("transformers.integrations.gguf")
    tokenizer = tiny_tokenizer()
    path = write_gguf(tmp_path / "m.gguf", tiny_hf_model("llama", tokenizer.get_vocab_size()), tokenizer, pre=pre)
    ours = load_checkpoint(path).tokenizer
    architecture, tokenizer_dict, _ = convert.get_gguf_tokenizer(str(path))
    theirs, _ = convert.convert_gguf_tokenizer(architecture, tokenizer_dict)
    for text in SAMPLES:
        assert ours.encode(text).ids == theirs.encode(text).ids, (pre, text)
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
