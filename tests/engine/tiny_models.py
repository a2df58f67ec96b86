"""Tiny random checkpoints of each architecture, built with transformers (test-only dependency)."""
from __future__ import annotations

import torch

from batchd.engine.config import ModelConfig
from batchd.engine.model import Transformer

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

ARCHITECTURES = {
    "llama": dict(rope_theta=10000.0),
    "llama3-rope": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen2": dict(rope_theta=1000000.0),
    "qwen3": dict(rope_theta=1000000.0, head_dim=32),
    "llama-tied": dict(tie_word_embeddings=True),
}


def hf_model(name: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    extra = dict(ARCHITECTURES[name])
    if name.startswith("llama"):
        cfg = transformers.LlamaConfig(**TINY, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    elif name == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, **extra)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**TINY, **extra)
        model = transformers.Qwen3ForCausalLM(cfg)
    # random weights are too small to make distinct logits; widen them so argmax is well defined
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 1:
                p.normal_(0, 0.2 if p.dim() == 2 else 0.05).add_(1.0 if p.dim() == 1 and "norm" in _name(model, p) else 0.0)
    return model.float().eval()


def _name(model, param) -> str:
    for n, p in model.named_parameters():
        if p is param:
            return n
    return ""


def ours_from_hf(model) -> Transformer:
    config = ModelConfig.from_hf_dict(model.config.to_dict())
    ours = Transformer(config)
    ours.load_hf_tensors(dict(model.state_dict()))
    return ours.eval()
