"""Hugging Face folders written by transformers load back as the same tensors, config and tokenizer."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchd.engine.checkpoint import Checkpoint, load_checkpoint
from batchd.engine.checkpoint.validate import expected_shapes
from tests.engine.test_checkpoint_builders import (CHAT_TEMPLATE, TEXT, hf_state_dict, tiny_hf_model,
                                                   tiny_tokenizer, write_hf_folder)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_hf_folder_round_trip_returns_the_saved_tensors(tmp_path, tokenizer, arch, tied):
    model = tiny_hf_model(arch, tokenizer.get_vocab_size(), tied=tied)
    ckpt = load_checkpoint(write_hf_folder(tmp_path / arch, model, tokenizer))

    assert isinstance(ckpt, Checkpoint) and ckpt.format == "hf"
    expected = hf_state_dict(model)
    assert ckpt.tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    assert ("lm_head.weight" in ckpt.tensors) == (not tied)
    assert set(ckpt.tensors) == set(expected_shapes(ckpt.config))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_config_carries_architecture_flags(tmp_path, tokenizer, arch):
    model = tiny_hf_model(arch, tokenizer.get_vocab_size())
    config = load_checkpoint(write_hf_folder(tmp_path, model, tokenizer)).config

    assert config.architecture == arch
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (2, 64, 4, 2)
    assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.rms_norm_eps == pytest.approx(1e-6)
    assert config.vocab_size == tokenizer.get_vocab_size()


def test_llama3_rope_scaling_reaches_the_config(tmp_path, tokenizer):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    model = tiny_hf_model("llama", tokenizer.get_vocab_size(), rope_theta=500000.0,
                         rope_scaling=dict(scaling), max_position_embeddings=16384)  # transformers edits the dict
    config = load_checkpoint(write_hf_folder(tmp_path, model, tokenizer)).config

    assert config.rope_theta == 500000.0
    assert {k: config.rope_scaling[k] for k in scaling} == scaling


def test_sharded_folder_loads_and_hashes_its_shards_in_order(tmp_path, tokenizer):
    model = tiny_hf_model("qwen2", tokenizer.get_vocab_size())
    folder = write_hf_folder(tmp_path, model, tokenizer, max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2

    ckpt = load_checkpoint(folder)
    for name, tensor in hf_state_dict(model).items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    digests = "".join(hashlib.sha256((folder / s).read_bytes()).hexdigest() for s in shards)
    assert ckpt.sha256 == hashlib.sha256(digests.encode()).hexdigest()
    assert ckpt.weight_bytes == sum((folder / s).stat().st_size for s in shards)


def test_single_file_sha256_is_the_file_hash(tmp_path, tokenizer):
    folder = write_hf_folder(tmp_path, tiny_hf_model("llama", tokenizer.get_vocab_size()), tokenizer)
    ckpt = load_checkpoint(folder)
    weights = (folder / "model.safetensors").read_bytes()
    assert ckpt.sha256 == hashlib.sha256(weights).hexdigest()
    assert ckpt.weight_bytes == len(weights)
    assert ckpt.path == str(folder)


def test_tokenizer_template_and_special_tokens_come_from_the_folder(tmp_path, tokenizer):
    ckpt = load_checkpoint(write_hf_folder(tmp_path, tiny_hf_model("llama", tokenizer.get_vocab_size()), tokenizer))

    assert ckpt.tokenizer.encode(TEXT).ids == tokenizer.encode(TEXT).ids
    assert ckpt.chat_template == CHAT_TEMPLATE
    assert ckpt.eos_token == "<|im_end|>"
    assert ckpt.bos_token == "<|im_start|>"  # not in tokenizer_config.json: from config.json's bos_token_id
    assert ckpt.special_token_ids == {0, 1, 2}
    assert 2 in ckpt.config.eos_token_ids


def test_null_bos_in_tokenizer_config_means_no_bos(tmp_path, tokenizer):
    folder = write_hf_folder(tmp_path, tiny_hf_model("qwen2", tokenizer.get_vocab_size()), tokenizer)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
    ckpt = load_checkpoint(folder)
    assert ckpt.bos_token is None and ckpt.eos_token == "<|im_end|>"


def test_stored_copy_of_a_tied_lm_head_is_dropped(tmp_path, tokenizer):
    model = tiny_hf_model("llama", tokenizer.get_vocab_size(), tied=True)
    folder = write_hf_folder(tmp_path, model, tokenizer)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    ckpt = load_checkpoint(folder)
    assert "lm_head.weight" not in ckpt.tensors and ckpt.config.tie_word_embeddings


def test_chat_template_jinja_file_and_generation_config_eos(tmp_path, tokenizer):
    folder = write_hf_folder(tmp_path, tiny_hf_model("llama", tokenizer.get_vocab_size()), tokenizer)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ckpt = load_checkpoint(folder)

    assert ckpt.chat_template == "{{ messages[0]['content'] }}"
    assert ckpt.eos_token == "<|im_end|>"
    assert ckpt.config.eos_token_ids == [2, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_converts_every_tensor(tmp_path, tokenizer, dtype):
    model = tiny_hf_model("qwen3", tokenizer.get_vocab_size())
    ckpt = load_checkpoint(write_hf_folder(tmp_path, model, tokenizer), dtype=dtype)
    for name, tensor in hf_state_dict(model).items():
        assert ckpt.tensors[name].dtype == dtype
        assert torch.equal(ckpt.tensors[name], tensor.to(dtype)), name
