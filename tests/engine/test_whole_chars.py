"""Byte-safe output (issue 38, item 8): a text cut inside a multi-byte UTF-8 character ends on
its last whole character, the bytes held back are counted, and a U+FFFD the model wrote stays.
Byte-level BPE is SmolLM2's real tokenizer; byte fallback is a small SentencePiece-style one."""
from __future__ import annotations

import hashlib

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from batchd.engine.checkpoint.gguf_file import read_gguf, tokenizer_parts
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.text import TextCodec
from batchd.engine.types import GenerationRequest, SamplingParams
from batchd.engine.whole_chars import TokenBytes, byte_level_alphabet
from tests.conftest import smollm2_gguf_path

MIXED = "Hi 🌟🚀 ok → 中文 ü, naïve 👩‍👩‍👧 done"


@pytest.fixture(scope="module")
def smollm2_codec() -> TextCodec:
    tokenizer, template, bos, eos, _ = tokenizer_parts(read_gguf(smollm2_gguf_path()))
    return TextCodec(tokenizer, template, bos, eos)


def byte_fallback_codec() -> TextCodec:
    """SentencePiece style, as Llama 2 and Mistral ship it: '▁' for spaces, a few pieces, and
    every other byte as a '<0xAB>' token."""
    vocab = {"<unk>": 0, "</s>": 1, "▁Hi": 2, "▁ok": 3, "▁": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["</s>"])
    return TextCodec(tokenizer)


def codecs_under_test(smollm2_codec):
    return {"byte-level": smollm2_codec, "byte-fallback": byte_fallback_codec()}


def test_token_bytes_are_what_the_tokenizer_decodes(smollm2_codec):
    token_bytes = TokenBytes(smollm2_codec.tokenizer)
    checked = 0
    for token_id in range(smollm2_codec.tokenizer.get_vocab_size()):
        data = token_bytes(token_id)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue   # a piece of a character: what the prefixes test below is about
        assert smollm2_codec.decode([token_id]) == text, token_id
        checked += 1
    assert checked > smollm2_codec.tokenizer.get_vocab_size() // 2


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_every_prefix_ends_on_a_whole_character(smollm2_codec, kind):
    codec = codecs_under_test(smollm2_codec)[kind]
    ids = codec.encode(MIXED, add_special_tokens=False)
    token_bytes = TokenBytes(codec.tokenizer)
    held_somewhere = 0
    for n in range(1, len(ids) + 1):
        text, held = codec.decode_whole_chars(ids[:n])
        assert "\ufffd" not in text and MIXED.lstrip().startswith(text.lstrip()), (n, text)
        raw = b"".join(token_bytes(i) for i in ids[:n])
        stripped = 1 if kind == "byte-fallback" else 0   # its decoder drops the space '▁' puts before word one
        assert len(text.encode("utf-8")) + held == len(raw) - stripped, n
        if codec.decode(ids[:n]) == text:
            assert held == 0   # a whole text is exactly the tokenizer's own decode
        held_somewhere += held
    assert held_somewhere > 0
    assert codec.decode_whole_chars(ids) == (MIXED, 0)


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_a_replacement_character_the_model_wrote_stays(smollm2_codec, kind):
    codec = codecs_under_test(smollm2_codec)[kind]
    for text in ("a\ufffd", "a\ufffdb", "\ufffd"):
        ids = codec.encode(text, add_special_tokens=False)
        assert codec.decode_whole_chars(ids) == (text, 0)


def test_bytes_that_can_never_be_valid_stay(smollm2_codec):
    # a lone continuation byte after 'a': no later byte could make it a character
    char_of_byte = {byte: ch for ch, byte in byte_level_alphabet().items()}
    lone = smollm2_codec.tokenizer.token_to_id(char_of_byte[0x80])
    ids = smollm2_codec.encode("a", add_special_tokens=False) + [lone]
    assert smollm2_codec.decode_whole_chars(ids) == ("a\ufffd", 0)


def test_the_engine_holds_back_an_unfinished_emoji():
    engine = Engine.load(str(smollm2_gguf_path()), EngineConfig(max_context=256))
    request = GenerationRequest(prompt="Reply only with emoji: a happy face, a heart, a rocket.", chat=True,
                                sampling=SamplingParams(max_new_tokens=4))
    result = engine.generate(request)
    raw = engine.codec.decode(result.token_ids)
    assert raw.endswith("\ufffd")   # the budget cut a character (SmolLM2's greedy answer: a 4-byte emoji, 2 tokens)
    assert not result.text.endswith("\ufffd") and raw.startswith(result.text)
    assert result.telemetry.output_dropped_bytes > 0
    assert result.output_sha256 == hashlib.sha256(result.text.encode("utf-8")).hexdigest()
    token_bytes = TokenBytes(engine.codec.tokenizer)
    assert len(result.text.encode()) + result.telemetry.output_dropped_bytes == \
        sum(len(token_bytes(i)) for i in result.token_ids)
    stopped = engine.generate(GenerationRequest(prompt=request.prompt, chat=True, sampling=SamplingParams(
        max_new_tokens=4, stop=(result.text,))))
    assert stopped.text == "" and stopped.telemetry.output_dropped_bytes == 0   # the stop cut the tail away
