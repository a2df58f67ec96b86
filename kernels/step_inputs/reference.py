"""PyTorch twin of kernels.step_inputs: the engine's eager ops before the first layer."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from batchd.kernels.small_matmul.reference import NormInputs, norm_inputs_reference


class StepInputs(NamedTuple):
    """What the layers of one step read besides the weights."""
    positions: torch.Tensor            # [T] int64 cache rows written by this step: start + t
    seq_len: Optional[torch.Tensor]    # [1] int64 start + T (None when start is a host int)
    cos: torch.Tensor                  # [T, D] float32 rope table rows at `positions`
    sin: torch.Tensor                  # [T, D] float32
    hidden: torch.Tensor               # [B, T, H] the token embeddings (the residual stream)
    normed: Optional[NormInputs]       # the first layer's folded RMSNorm inputs of hidden [B * T, H]


def step_inputs_reference(tokens: torch.Tensor, start, embed_weight: torch.Tensor, rope_cos: torch.Tensor,
                          rope_sin: torch.Tensor, norm_weight: Optional[torch.Tensor]) -> StepInputs:
    T = tokens.shape[1]
    offsets = torch.arange(T, device=tokens.device)
    on_device = isinstance(start, torch.Tensor)
    positions = start + offsets
    seq_len = start + T if on_device else None
    hidden = F.embedding(tokens, embed_weight)
    normed = None if norm_weight is None else norm_inputs_reference(hidden.view(-1, hidden.shape[-1]), norm_weight)
    return StepInputs(positions, seq_len, rope_cos[positions], rope_sin[positions], hidden, normed)
