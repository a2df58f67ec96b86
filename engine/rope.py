"""Rotary position embeddings (RoPE), with the scaling rules of the supported checkpoints.

Layout is Hugging Face's "rotate half" (applied by `engine.fused.rotate`): the two halves of
head_dim form the pairs, so tensors from HF checkpoints (and GGUF files after un-permutation) work
unchanged.
"""
from __future__ import annotations

import math

import torch

from batchd.engine.config import ModelConfig
from batchd.engine.errors import CheckpointError


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as the checkpoint's rope_scaling says."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise CheckpointError(f"unsupported rope scaling {kind!r}; batchd supports linear and llama3")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_tables(config: ModelConfig, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables: [max_len, head_dim] float32 (each frequency repeated for both halves)."""
    inv_freq = inverse_frequencies(config).to(device)
    positions = torch.arange(max_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()
