"""Named shapes of real models (../shared/MODELS.md), for benchmarks with random weights."""
from __future__ import annotations

from batchd.engine.architectures import architecture
from batchd.engine.config import ModelConfig

PRESETS = {
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, intermediate_size=1536, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(architecture="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                         num_kv_heads=2, intermediate_size=4864, rope_theta=1000000.0, tie_word_embeddings=True,
                         attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(architecture="qwen2", vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                         num_kv_heads=2, intermediate_size=8960, rope_theta=1000000.0, tie_word_embeddings=True,
                         attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-6),
    "llama-3-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=8, intermediate_size=14336, rope_theta=500000.0, max_position_embeddings=131072),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def hf_config_dict(config: ModelConfig) -> dict:
    """The same shape as a transformers config dict (to build the reference model)."""
    return {
        "architectures": [architecture(config.architecture).hf_class], "model_type": config.architecture,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "intermediate_size": config.intermediate_size,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
    }
