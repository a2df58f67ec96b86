"""Tiny models written as GGUF the way llama.cpp's converter writes them load back as the HF tensors:
names mapped, llama's q/k row permutation undone, quantised types dequantised, config and
tokenizer rebuilt from the metadata."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from batchd.engine.checkpoint import load_checkpoint
from batchd.engine.checkpoint.gguf_file import llama3_rope_factors
from tests.engine.test_checkpoint_builders import (CHAT_TEMPLATE, TEXT, hf_state_dict, quantize_like_gguf,
                                                   tiny_hf_model, tiny_tokenizer, write_gguf, write_hf_folder)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_f32_gguf_returns_the_hf_tensors_exactly(tmp_path, tokenizer, arch, tied):
    model = tiny_hf_model(arch, tokenizer.get_vocab_size(), tied=tied)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", model, tokenizer))

    expected = hf_state_dict(model)
    assert ckpt.format == "gguf"
    assert ckpt.tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ckpt.tensors[name], tensor), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_0_gguf_returns_the_quantised_hf_tensors(tmp_path, tokenizer, arch):
    model = tiny_hf_model(arch, tokenizer.get_vocab_size())
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", model, tokenizer, qtype=QT.Q8_0))

    for name, tensor in hf_state_dict(model).items():
        # Q8_0 blocks run along rows, so quantising the permuted rows equals quantising the HF rows
        expected = quantize_like_gguf(tensor, QT.Q8_0) if tensor.dim() == 2 else tensor
        assert torch.equal(ckpt.tensors[name], expected), name
        assert torch.allclose(ckpt.tensors[name], tensor, atol=2e-3), name


def test_llama_q_and_k_come_back_unpermuted(tmp_path, tokenizer):
    # q and k have different head counts (4 and 2): each must be undone with its own
    model = tiny_hf_model("llama", tokenizer.get_vocab_size())
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", model, tokenizer))
    for proj in ("q_proj", "k_proj"):
        ours = ckpt.tensors[f"model.layers.1.self_attn.{proj}.weight"]
        assert torch.equal(ours, model.state_dict()[f"model.layers.1.self_attn.{proj}.weight"])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_config_equals_the_hf_config(tmp_path, tokenizer, arch):
    model = tiny_hf_model(arch, tokenizer.get_vocab_size())
    from_gguf = load_checkpoint(write_gguf(tmp_path / "m.gguf", model, tokenizer)).config
    from_hf = load_checkpoint(write_hf_folder(tmp_path / "hf", model, tokenizer)).config

    from_gguf.max_position_embeddings = from_hf.max_position_embeddings  # both 256; keep the diff readable
    assert from_gguf == from_hf


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, tokenizer):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    model = tiny_hf_model("llama", tokenizer.get_vocab_size(), rope_theta=500000.0,
                         rope_scaling=dict(scaling), max_position_embeddings=16384)  # transformers edits the dict
    factors = llama3_rope_factors(16, 500000.0, scaling).numpy()
    assert 1.0 < np.median(factors) and factors.min() == 1.0 and factors.max() == 8.0  # all three regimes
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", model, tokenizer, rope_freqs=factors))

    assert ckpt.config.rope_scaling == scaling
    assert "rope_freqs.weight" not in ckpt.tensors


def test_yarn_and_linear_rope_scaling_metadata_reach_the_config(tmp_path, tokenizer):
    model = tiny_hf_model("qwen2", tokenizer.get_vocab_size())
    yarn = write_gguf(tmp_path / "yarn.gguf", model, tokenizer, metadata={
        "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768})
    linear = write_gguf(tmp_path / "linear.gguf", model, tokenizer, metadata={
        "qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 2.0})

    assert load_checkpoint(yarn).config.rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert load_checkpoint(linear).config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_gguf_tokenizer_matches_the_hf_tokenizer(tmp_path, tokenizer):
    model = tiny_hf_model("llama", tokenizer.get_vocab_size())
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", model, tokenizer))
    text = TEXT + " <|im_start|>user\nnaïve café 2024<|im_end|>\n"

    assert ckpt.tokenizer.encode(text).ids == tokenizer.encode(text).ids
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode(text).ids, skip_special_tokens=False) == text
    assert ckpt.chat_template == CHAT_TEMPLATE
    assert (ckpt.bos_token, ckpt.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ckpt.special_token_ids == {0, 1, 2}


def test_gguf_sha256_and_size_are_the_files(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "m.gguf", tiny_hf_model("qwen3", tokenizer.get_vocab_size()), tokenizer)
    ckpt = load_checkpoint(path)
    assert ckpt.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert ckpt.weight_bytes == path.stat().st_size
    assert ckpt.path == str(path)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K, QT.Q6_K, QT.F16])
def test_mixed_quant_types_in_one_file(tmp_path, tokenizer, qtype):
    # hidden 64 is too short for 256-weight K blocks in most tensors; quantise the ones that fit
    model = tiny_hf_model("llama", tokenizer.get_vocab_size(), intermediate_size=256)
    fits = {f"blk.{i}.ffn_down.weight": qtype for i in range(2)}
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", model, tokenizer, tensor_types=fits))
    down = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]
    assert down.shape == (64, 256) and torch.isfinite(down).all()
    if qtype in (QT.Q4_0, QT.F16):  # types the gguf package can quantise: check the values too
        expected = model.state_dict()["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(down, quantize_like_gguf(expected, qtype) if qtype == QT.Q4_0 else expected.half().float())


def test_bfloat16_load_equals_rounding_the_float32_load(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "m.gguf", tiny_hf_model("llama", tokenizer.get_vocab_size()), tokenizer,
                      qtype=QT.Q8_0)
    full, half = load_checkpoint(path), load_checkpoint(path, dtype=torch.bfloat16)
    for name, tensor in full.tensors.items():
        assert half.tensors[name].dtype == torch.bfloat16
        assert torch.equal(half.tensors[name], tensor.to(torch.bfloat16)), name
