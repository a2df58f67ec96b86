"""The forward of a step's continuing prompt chunks (those past a prompt's first): all of them in
one pass over the paged pool.

    logits = forward_chunks(model, cache, chunks, slab_rows=64, max_context=...)   # [C, V] float32

A chunk is a run of prompt positions [start, end) of one sequence, whose earlier positions are
already in the pool. Each layer writes the chunks' keys and values into their blocks and runs
kernels.paged_prefill over the pool: nothing is gathered into a contiguous cache, and the chunks
of many long prompts cost one pass.

On CUDA short first chunks join the pass too (`ChunkPacking`): PFlash's compressed prompts are
all short, and one 800-row GEMM per prompt leaves the H200's tensor cores a third idle (a
Llama-3-8B layer's four projections, bf16: 0.74 us a row at 832 rows, 0.62 at 1,024, 0.61 at 4,096).

Batch invariance (docs/engine.md): a chunk's rows are computed the same way whatever else is in
the step. Projections run in fixed slabs of `ChunkPacking.slab_rows` rows over the packed rows
(CUDA: the library sees one GEMM shape, so a row's bits follow from its own values) or per chunk
(the CPU: a chunk's GEMM shape is its own length, and chunk boundaries are fixed by the sequence:
engine.batch.scheduler), norms one row at a time (kernels.rms_norm),
rope and the MLP's gate elementwise (on CUDA kernels.silu_mul for every packed row, whatever
the row count; residual adds inside the next norm's kernel), attention in tiles counted from
each chunk's first row; the logits of each chunk's last row go through the fixed-shape slabs of the decode rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from batchd.engine.batch.rows import (add_norm_rows, norm_rows, project_invariant, project_slabs, rope_and_write_rows,
                                      silu_mul_rows)
from batchd.kernels.paged_prefill import paged_prefill_attention

CHUNK_SLAB_ROWS = 1024     # CUDA prompt-chunk GEMMs: as fast a row as 4,096-row ones, little padding
PACKED_FIRST_TOKENS = 2048  # first chunks up to this long join the packed pass (longer: the one-sequence prefill)


@dataclass(frozen=True)
class ChunkPacking:
    """Which prompt chunks run in the packed pass over the pool, and how its projections split.

    slab_rows None (the CPU): one GEMM per chunk, and only continuing chunks take the pass; a
    first chunk runs the one-sequence prefill (engine.batch.first_chunks). With slab_rows, first
    chunks of up to `first_tokens` tokens join the pass as well. Which path a chunk takes follows
    from the chunk alone, so its bits never depend on the rest of the step."""

    slab_rows: Optional[int] = None
    first_tokens: int = PACKED_FIRST_TOKENS

    @classmethod
    def for_device(cls, device, slab_rows: Optional[int]) -> "ChunkPacking":
        """slab_rows None: CHUNK_SLAB_ROWS on CUDA, per chunk on the CPU; 0: per chunk anywhere."""
        if slab_rows is None:
            slab_rows = CHUNK_SLAB_ROWS if torch.device(device).type == "cuda" else 0
        return cls(slab_rows or None)

    def in_pass(self, start: int, end: int) -> bool:
        """Whether the chunk [start, end) of a prompt runs in the packed pass."""
        return start > 0 or (self.slab_rows is not None and end <= self.first_tokens)


@dataclass
class ChunkBatch:
    """The packed rows of C chunks on the model's device, and their bounds on the host.

    tokens, positions: [N] long; write_blocks, write_offsets: [N] long (where each row's key and
    value go); block_tables: [C, max_blocks] int32; row_starts, chunk_rows, first_positions: [C]
    int32; bounds: [(row start, row end)] per chunk (host)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    block_tables: torch.Tensor
    row_starts: torch.Tensor
    chunk_rows: torch.Tensor
    first_positions: torch.Tensor
    bounds: list[tuple[int, int]]

    @classmethod
    def build(cls, chunks, block_size: int, pad_block: int, device) -> "ChunkBatch":
        """chunks: (token ids, first position, block table) per chunk."""
        tokens, positions, blocks, bounds, firsts = [], [], [], [], []
        width = max(len(table) for _, _, table in chunks)
        tables = torch.full((len(chunks), width), pad_block, dtype=torch.int32)
        for c, (ids, first, table) in enumerate(chunks):
            bounds.append((len(tokens), len(tokens) + len(ids)))
            firsts.append(first)
            tokens += ids
            span = range(first, first + len(ids))
            positions += span
            blocks += [table[p // block_size] for p in span]
            tables[c, : len(table)] = torch.tensor(table, dtype=torch.int32)
        position_tensor = torch.tensor(positions, dtype=torch.long)
        meta = torch.tensor([[a for a, _ in bounds], [b - a for a, b in bounds], firsts], dtype=torch.int32)
        return cls(torch.tensor(tokens, dtype=torch.long).to(device), position_tensor.to(device),
                   torch.tensor(blocks, dtype=torch.long).to(device), (position_tensor % block_size).to(device),
                   tables.to(device), *meta.to(device), bounds)


def project_chunks(x: torch.Tensor, bounds: list[tuple[int, int]], weight: torch.Tensor,
                   bias: Optional[torch.Tensor], slab_rows: Optional[int] = None) -> torch.Tensor:
    """x: [N, K] -> [N, Nout]: fixed slabs of `slab_rows` over all rows, or (None) one GEMM per
    chunk; either way a row's bits follow from its chunk alone."""
    if slab_rows is not None:
        return project_slabs(x, weight, bias, slab_rows)
    if len(bounds) == 1:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[a:b], weight, bias) for a, b in bounds])


@torch.inference_mode()
def forward_chunks(model, cache, batch: ChunkBatch, *, slab_rows: Optional[int], max_context: int,
                   chunk_slab_rows: Optional[int] = None) -> torch.Tensor:
    """Write every chunk's keys and values into the pool; return the next-token logits of each
    chunk's last row ([C, V] float32). slab_rows: the decode rows' slab (the logits);
    chunk_slab_rows: the chunks' projections (`ChunkPacking.slab_rows`)."""
    config = model.config
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    model.setup_rope(max_context)
    bounds = batch.bounds
    host_rows = [b - a for a, b in bounds]
    hidden = model.embed_tokens(batch.tokens)                                       # [N, H]
    cos, sin = model.rope_cos[batch.positions][:, None], model.rope_sin[batch.positions][:, None]   # [N, 1, D]
    added = None   # the last sublayer's output [N, H], added to `hidden` by the next norm's kernel
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        x, hidden = add_norm_rows(added, hidden, layer.input_layernorm.weight, layer.input_layernorm.eps)
        qkv = project_chunks(x, bounds, attn.qkv_proj.weight, attn.qkv_proj.bias, chunk_slab_rows)
        q, k, v = qkv.split(attn.split_sizes, dim=-1)
        q, k, v = q.reshape(-1, Hq, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)
        if attn.q_norm is not None:  # qwen3: per-head norms before rope
            q = norm_rows(q.reshape(-1, D), attn.q_norm.weight, attn.q_norm.eps).view(-1, Hq, D)
            k = norm_rows(k.reshape(-1, D), attn.k_norm.weight, attn.k_norm.eps).view(-1, Hkv, D)
        q = rope_and_write_rows(q, k, v, cos, sin, cache, i, batch.write_blocks, batch.write_offsets)
        keys, values = cache.keys[i], cache.values[i]
        out = paged_prefill_attention(q.to(keys.dtype), keys, values, batch.block_tables, batch.row_starts,
                                      batch.chunk_rows, batch.first_positions, scale=attn.scale,
                                      host_chunk_rows=host_rows).to(hidden.dtype)
        added = project_chunks(out.reshape(-1, Hq * D), bounds, attn.o_proj.weight, None, chunk_slab_rows)
        post = layer.post_attention_layernorm
        x, hidden = add_norm_rows(added, hidden, post.weight, post.eps)
        mlp = layer.mlp
        gate_up = project_chunks(x, bounds, mlp.gate_up_proj.weight, None, chunk_slab_rows)
        added = project_chunks(silu_mul_rows(gate_up), bounds, mlp.down_proj.weight, None, chunk_slab_rows)
    ends = torch.tensor([b - 1 for _, b in bounds], device=hidden.device)
    last = hidden[ends] + added[ends]                                               # [C, H]
    normed = norm_rows(last, model.norm.weight, model.norm.eps)
    return project_invariant(normed, model.lm_head.weight, None, slab_rows, model.lm_head).float()
