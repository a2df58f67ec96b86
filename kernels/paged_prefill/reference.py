"""PyTorch twin of the paged prefill kernel: each chunk gathers its sequence's keys and values
from the pool and attends over them in float32 with a lower-right causal mask."""
from __future__ import annotations

import torch

from batchd.kernels.paged_attention.reference import gather_rows


def paged_prefill_attention_reference(q, k_pool, v_pool, block_tables, row_starts, chunk_rows, first_positions, *,
                                      scale: float) -> torch.Tensor:
    """q [N, Hq, D] -> [N, Hq, D]; row i of chunk c sees positions [0, first_positions[c] + i]."""
    _, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    out = torch.zeros_like(q)
    for c in range(block_tables.shape[0]):
        start, rows, first = int(row_starts[c]), int(chunk_rows[c]), int(first_positions[c])
        length = first + rows
        keys = gather_rows(k_pool, block_tables[c], length).float()            # [Hkv, S, D]
        values = gather_rows(v_pool, block_tables[c], length).float()
        qc = q[start : start + rows].float().permute(1, 0, 2).reshape(Hkv, Hq // Hkv * rows, D)   # [Hkv, G*T, D]
        logits = qc @ keys.transpose(1, 2) * scale                              # [Hkv, G*T, S]
        position = first + torch.arange(rows, device=q.device).repeat(Hq // Hkv)    # each lane's position
        hidden = torch.arange(length, device=q.device)[None, :] > position[:, None]
        probs = logits.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[start : start + rows] = (probs @ values).reshape(Hq, rows, D).permute(1, 0, 2).to(q.dtype)
    return out
