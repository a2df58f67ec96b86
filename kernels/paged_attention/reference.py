"""PyTorch twin of the paged decode attention kernel: each row gathers its sequence's keys and
values from the pool and attends over them in float32."""
from __future__ import annotations

import torch


def gather_rows(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """pool [blocks, Hkv, block_size, D], block_table [>= ceil(length / block_size)] ->
    the sequence's rows [Hkv, length, D] in position order (a copy)."""
    block_size = pool.shape[2]
    n_blocks = -(-length // block_size)
    blocks = pool.index_select(0, block_table[:n_blocks].long())      # [n, Hkv, bs, D]
    return blocks.transpose(0, 1).reshape(pool.shape[1], n_blocks * block_size, pool.shape[3])[:, :length]


def paged_decode_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, *, scale: float) -> torch.Tensor:
    """q [N, Hq, D] -> [N, Hq, D]; row n sees its sequence's positions [0, seq_lens[n])."""
    N, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    out = torch.empty_like(q)
    for n in range(N):
        length = int(seq_lens[n])
        keys = gather_rows(k_pool, block_tables[n], length).float()        # [Hkv, S, D]
        values = gather_rows(v_pool, block_tables[n], length).float()
        qn = q[n].float().view(Hkv, Hq // Hkv, D)                          # heads sharing a KV head
        probs = torch.softmax(qn @ keys.transpose(1, 2) * scale, dim=-1)  # [Hkv, G, S]
        out[n] = (probs @ values).reshape(Hq, D).to(q.dtype)
    return out
