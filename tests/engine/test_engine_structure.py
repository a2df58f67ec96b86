"""The seams the engine leaves for what comes next: one registry row per architecture, a KV-cache
interface, one EngineConfig, and the kernel choice held by the model rather than module globals."""
from __future__ import annotations

import pytest
import torch

from batchd.engine import fused
from batchd.engine.architectures import ARCHITECTURES, GGUF_ARCHITECTURES, HF_ARCHITECTURE_NAMES, architecture
from batchd.engine.capabilities import CAPABILITIES
from batchd.engine.config import ModelConfig
from batchd.engine.errors import CheckpointError
from batchd.engine.kv_cache import ContiguousKVCache, KVCache
from batchd.engine.presets import hf_config_dict, preset
from batchd.engine.runtime import Engine, EngineConfig


def test_every_architecture_has_one_row_that_the_readers_use():
    assert set(CAPABILITIES) == set(ARCHITECTURES) == {"llama", "qwen2", "qwen3", "deepseek_v4"}
    for name, row in ARCHITECTURES.items():
        assert HF_ARCHITECTURE_NAMES[row.hf_class] == name
        assert GGUF_ARCHITECTURES.get(row.gguf_name) == name or not row.gguf_name   # V4: no GGUF reader
    qwen2 = ModelConfig.from_hf_dict(hf_config_dict(preset("qwen2.5-0.5b", attention_bias=False)))
    assert qwen2.attention_bias and not qwen2.qk_norm          # the row forces q/k/v biases
    with pytest.raises(CheckpointError, match="unsupported architecture 'mamba'"):
        architecture("mamba")


def test_the_contiguous_cache_implements_the_interface():
    cache = ContiguousKVCache(preset("smollm2-135m", num_layers=2), 16, "cpu", torch.float32)
    assert isinstance(cache, KVCache)
    cache.reserve(4)
    cache.advance(4)
    cache.truncate(2)
    assert cache.length == 2 and int(cache.length_on_device) == 2
    cache.reset()
    assert cache.length == 0 and cache.nbytes == 2 * 2 * 3 * 16 * 64 * 4


def test_one_engine_config_and_the_model_holds_its_kernels():
    config = preset("smollm2-135m", num_layers=2, vocab_size=256)
    engine = Engine.from_config(config, EngineConfig(max_context=64, prefill_chunk=16))
    assert engine.engine_config == EngineConfig(device="cpu", dtype="float32", max_context=64, prefill_chunk=16)
    assert engine.max_context == engine.cache.max_len == 64 and engine.prefill_chunk == 16
    assert engine.model.ops is fused.EAGER and engine.model.layers[0].mlp.ops is fused.EAGER
    assert engine.drafters.target.model is engine.model and engine.residency is engine.compressor.residency
    assert Engine.from_config(config).max_context == 8192
