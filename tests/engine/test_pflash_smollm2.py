"""PFlash end to end on SmolLM2 (CPU, fp32) with real aclsum papers: the configured fraction is
kept, with the head, the tail and the question, in order; across tokenizers and self-drafting;
and the feature gate around it."""
from __future__ import annotations

import json

import pytest

from batchd.engine.capabilities import check_features
from batchd.engine.config import ModelConfig
from batchd.engine.errors import UnsupportedFeatureError
from batchd.engine.pflash import compress_for_request
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.types import CompressionOptions, GenerationRequest, SamplingParams, Telemetry
from tests.engine.test_pflash_helpers import llama3_tokenizer_json, long_paper_text, smollm2_folder, tiny_drafter

QUESTION = "Question: what problem does this paper address, and which method does it propose?"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(str(smollm2_folder()), EngineConfig(max_context=8192))


@pytest.fixture(scope="module")
def llama3_drafter(tmp_path_factory) -> str:
    return str(tiny_drafter(tmp_path_factory.mktemp("llama3-drafter"), llama3_tokenizer_json()))


def paper_prompt(words: int) -> str:
    return " ".join(long_paper_text().split(" ")[:words]) + "\n\n" + QUESTION


def compress(engine, prompt: str, **options) -> tuple[list[int], list[int], Telemetry]:
    request = GenerationRequest(prompt=prompt, chat=True, compression=CompressionOptions(**options))
    ids = engine.codec.encode_request(request.prompt, None, True)
    telemetry = Telemetry()
    return ids, compress_for_request(engine, ids, request, telemetry), telemetry


def assert_in_order(pieces: list[str], text: str) -> None:
    at = 0
    for piece in pieces:
        found = text.find(piece, at)
        assert found >= at, f"kept piece {piece[:40]!r} is not in the prompt after position {at}"
        at = found + len(piece)


def test_cross_tokenizer_keeps_fraction_head_tail_question_in_order(engine, llama3_drafter):
    prompt = paper_prompt(2600)
    ids, out, tel = compress(engine, prompt, mode="always", keep_ratio=0.2, drafter_path=llama3_drafter)
    report = engine.compressor.last_report
    view, sel = report.view, report.selection
    assert not view.same_tokenizer and view.ids != ids
    # the configured fraction of the drafter's chunks, within one chunk (only the prompt's last
    # chunk may be partial)
    assert 0 <= 0.2 * sel.num_chunks - len(sel.kept_chunks) < 1
    assert 0 <= len(sel.kept_chunks) * sel.chunk_size - report.drafter_tokens_kept < sel.chunk_size
    # head, tail and question kept; everything kept appears in the prompt's order
    text = engine.codec.decode(out, skip_special_tokens=False)
    original = engine.codec.decode(ids, skip_special_tokens=False)
    assert text.startswith(original[:100])
    assert text.endswith(QUESTION + "<|im_end|>\n<|im_start|>assistant\n")
    assert_in_order([view.text[view.bounds[s]:view.bounds[e]] for s, e in sel.spans], original)
    assert text == "".join(view.text[view.bounds[s]:view.bounds[e]] for s, e in sel.spans)
    # telemetry: before, drafter kept, effective, seconds
    assert tel.compressed and tel.compress_tokens_before == len(ids)
    assert tel.compress_drafter_tokens_kept == report.drafter_tokens_kept
    assert 0.1 * len(ids) < len(out) < 0.3 * len(ids)
    assert tel.compress_s > 0 and tel.scoring_s > 0 and tel.drafter_load_s > 0
    assert tel.compress_s >= tel.scoring_s + tel.drafter_load_s


def test_cross_tokenizer_reappends_a_cut_instruction(engine, llama3_drafter):
    ids, out, tel = compress(engine, paper_prompt(2600), mode="always", keep_ratio=0.02, drafter_path=llama3_drafter)
    report = engine.compressor.last_report
    assert report.instruction_reappended
    assert any("re-appended it whole" in n for n in tel.notes)
    text = engine.codec.decode(out, skip_special_tokens=False)
    instruction = engine.codec.decode(ids[-96:], skip_special_tokens=False)
    assert text.endswith(instruction) and text.count(QUESTION) == 1
    assert len(out) < 0.1 * len(ids)


@pytest.mark.slow
def test_self_drafting_compresses_and_generates(engine):
    """No drafter given: SmolLM2 scores its own prompt (real attention), then answers."""
    prompt = paper_prompt(1000)
    request = GenerationRequest(prompt=prompt, chat=True, sampling=SamplingParams(max_new_tokens=12),
                                compression=CompressionOptions(mode="always", keep_ratio=0.25))
    result = engine.generate(request)
    tel = result.telemetry
    assert tel.compressed and any("target's own checkpoint drafts" in n for n in tel.notes)
    report = engine.compressor.last_report
    assert report.view.same_tokenizer
    assert result.effective_prompt_tokens == report.tokens_after < 0.35 * result.prompt_tokens
    assert result.prompt_tokens == tel.compress_tokens_before
    sel = report.selection
    assert sel.kept_chunks[: len(sel.head)] == list(range(len(sel.head))) and sel.head
    assert sel.kept_chunks[-1] == sel.num_chunks - 1
    assert result.generated_tokens > 0 and result.text.strip()


def test_auto_under_threshold_is_not_compressed_and_says_so(engine, llama3_drafter):
    ids, out, tel = compress(engine, paper_prompt(300), mode="auto", threshold_tokens=4096,
                             drafter_path=llama3_drafter)
    assert out == ids and not tel.compressed
    assert f"not compressed: {len(ids)} tokens < threshold 4096" in tel.notes


def test_auto_over_threshold_compresses(engine, llama3_drafter):
    ids, out, tel = compress(engine, paper_prompt(600), mode="auto", threshold_tokens=200, keep_ratio=0.3,
                             drafter_path=llama3_drafter)
    assert tel.compressed and len(out) < len(ids)


def test_always_compresses_under_the_threshold(engine, llama3_drafter):
    ids, out, tel = compress(engine, paper_prompt(600), mode="always", threshold_tokens=100_000, keep_ratio=0.3,
                             drafter_path=llama3_drafter)
    assert tel.compressed and len(out) < len(ids)


def test_keep_ratio_one_compresses_nothing_and_says_so(engine, llama3_drafter):
    ids, out, tel = compress(engine, paper_prompt(300), mode="always", keep_ratio=1.0, drafter_path=llama3_drafter)
    assert engine.codec.decode(out, skip_special_tokens=False) == engine.codec.decode(ids, skip_special_tokens=False)
    assert any("keeps every chunk" in n for n in tel.notes)


@pytest.mark.parametrize("options, message", [
    (dict(mode="always", keep_ratio=1.5), "--keep-ratio 1.5 is outside (0, 1]"),
    (dict(mode="always", keep_ratio=0.0), "--keep-ratio 0.0 is outside (0, 1]"),
    (dict(mode="always", drafter_path="/nonexistent/drafter"), "--compress-drafter /nonexistent/drafter: no such"),
    (dict(mode="sometimes"), "--compress 'sometimes' is not a mode"),
    (dict(mode="auto", threshold_tokens=-1), "--compress-threshold -1 is negative"),
])
def test_gate_refuses_bad_options_with_their_names(engine, options, message):
    request = GenerationRequest(prompt="Hello", compression=CompressionOptions(**options))
    with pytest.raises(UnsupportedFeatureError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.generate(request)


def test_gate_refuses_a_drafter_of_an_unsupported_architecture(engine, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    request = GenerationRequest(prompt="Hello", compression=CompressionOptions(mode="always",
                                                                             drafter_path=str(tmp_path)))
    with pytest.raises(UnsupportedFeatureError, match=f"--compress-drafter {tmp_path}: architecture 'gpt2' cannot be a PFlash drafter"):
        engine.generate(request)


def test_gate_needs_a_drafter_when_the_target_has_no_checkpoint():
    config = ModelConfig("llama", vocab_size=256, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=64)
    target = Engine.from_config(config, EngineConfig(max_context=128, cuda_graphs=False))
    with pytest.raises(UnsupportedFeatureError, match="needs --compress-drafter PATH"):
        target.compress(list(range(50)), GenerationRequest(prompt="x", compression=CompressionOptions(mode="always")),
                        Telemetry())


def test_check_features_takes_compression_options():
    notes = check_features("llama", "cpu", compression=CompressionOptions(mode="off", drafter_path="/x"))
    assert notes == ["--compress-drafter has no effect with --compress off"]
    with pytest.raises(UnsupportedFeatureError, match="cannot be a PFlash drafter"):
        check_features("qwen2", "cuda", compression=CompressionOptions(mode="auto"), drafter_architecture="gemma3")
    assert check_features("qwen3", "cuda", compression=CompressionOptions(mode="auto"),
                          drafter_architecture="qwen3") == []


def test_fingerprint_names_the_compression_drafter_of_compressed_jobs_only(engine, llama3_drafter):
    """A compressed job's output depends on the drafter's weights: their hash is in its fingerprint."""
    from pathlib import Path

    from batchd.engine.checkpoint.base import files_sha256

    def fingerprint_after(words: int, mode: str) -> dict:
        request = GenerationRequest(prompt=paper_prompt(words), chat=True, compression=CompressionOptions(
            mode=mode, threshold_tokens=4096, keep_ratio=0.3, drafter_path=llama3_drafter))
        engine.compress(engine.codec.encode_request(request.prompt, None, True), request, Telemetry())
        return engine.fingerprint(request)

    weights = sorted(Path(llama3_drafter).glob("*.safetensors"))
    assert fingerprint_after(600, "always")["compress_drafter_sha256"] == files_sha256(weights)
    assert fingerprint_after(300, "auto")["compress_drafter_sha256"] is None      # under the threshold
    assert fingerprint_after(300, "off")["compress_drafter_sha256"] is None
