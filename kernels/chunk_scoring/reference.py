"""Plain PyTorch twin of the PFlash scoring pass (materialises [Hq, T, S]; for tests and CPU)."""
from __future__ import annotations

import torch


def score_tail_queries_reference(
    q_tail: torch.Tensor,       # [Hq, T, D]
    k: torch.Tensor,            # [Hkv, S, D]
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """score[s] = max over heads of the mean over tail rows t of softmax(q k^T * scale)[h, t, s]. -> [S] f32

    Tail row t sits at position S - T + t and sees keys 0 .. S - T + t.
    """
    Hq, T, D = q_tail.shape
    Hkv, S, _ = k.shape
    qg = q_tail.to(compute_dtype).reshape(Hkv, Hq // Hkv, T, D)
    scores = torch.einsum("hgtd,hsd->hgts", qg, k.to(compute_dtype)) * scale     # [Hkv, G, T, S]
    positions = torch.arange(S - T, S, device=k.device)
    visible = torch.arange(S, device=k.device)[None, :] <= positions[:, None]     # [T, S]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return probs.mean(dim=2).amax(dim=(0, 1)).float()
