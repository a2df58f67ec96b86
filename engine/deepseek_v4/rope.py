"""V4's rotary embedding: partial (the trailing `rope_dim` channels of a head) and interleaved
(channels 2i and 2i+1 form a pair), in two families: "main" for sliding-window layers, "compress"
for CSA/HCA layers, their compressed entries and the indexer (optionally yarn-scaled).

Tables hold one angle per pair, `[max_len, rope_dim // 2]`, as transformers' DeepseekV4RotaryEmbedding.
"""
from __future__ import annotations

import math

import torch

from batchd.engine.deepseek_v4.config import RopeParams


def inverse_frequencies(params: RopeParams, rope_dim: int) -> tuple[torch.Tensor, float]:
    """([rope_dim // 2] float32 inverse frequencies, the cos/sin scale), as transformers computes
    them (default rope, or yarn with its truncated correction range)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim
    pos_freqs = params.theta**exponents
    if params.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = params.factor
    scale = params.attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    low, high = _yarn_correction_range(params, rope_dim)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: divide it by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(scale)


def _yarn_correction_range(params: RopeParams, dim: int) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(params.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(params.theta)))

    # transformers reads `truncate` from the top of V4's rope_parameters, where it never is: True
    low, high = math.floor(correction_dim(params.beta_fast)), math.ceil(correction_dim(params.beta_slow))
    return max(low, 0), min(high, dim - 1)


class RopeTable:
    """cos/sin of one family for positions [0, max_len): [max_len, rope_dim // 2] float32 each."""

    def __init__(self, params: RopeParams, rope_dim: int, max_len: int, device):
        inv_freq, scale = inverse_frequencies(params, rope_dim)
        angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None]
        self.cos = (angles.cos() * scale).to(device)
        self.sin = (angles.sin() * scale).to(device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] long -> cos, sin [..., rope_dim // 2]."""
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x in interleaved pairs; the leading
    (no-position) channels pass through. x: [..., D]; cos, sin broadcast to [..., rope_dim // 2].
    With -sin this undoes the rotation (the attention output's de-rotation)."""
    half = cos.shape[-1]
    if x.is_cuda:  # one complex product: 5 launches where the pairs' arithmetic below takes about 12
        pairs = torch.view_as_complex(x[..., -2 * half :].float().contiguous().unflatten(-1, (half, 2)))
        rotated = torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)
        return torch.cat([x[..., : -2 * half], rotated.to(x.dtype)], dim=-1)
    nope, rope = x[..., : -2 * half], x[..., -2 * half :].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]                         # [..., rope_dim // 2] each
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
