"""The forward of decode rows: many sequences' decode, verify and replay positions in one pass.

    logits = forward_rows(model, cache, rows, slab_rows=128)   # rows: RowBatch of N positions -> [N, V] float32

Every op here computes a row the same way whatever else is in the batch, which is what makes a
job's greedy output independent of its neighbours (docs/engine.md, "Batch invariance"):
- projections: CUDA multiplies fixed slabs of `slab_rows` rows (the last one zero-padded), so the
  library's GEMM sees one shape only and a row's bits never depend on the batch size; the CPU runs
  groups of at most 17 rows through engine.linear's row-invariant path;
- norms: kernels.rms_norm (one program per row, with the residual add before it) on CUDA, the
  float32 reference on the CPU;
- rope of q and k with the k/v write into the pool (one kernels.rope_paged launch on CUDA), silu * up
  (kernels.silu_mul on CUDA) and residual adds are elementwise, each rounded as the eager ops;
- attention: kernels.paged_attention, whose splits are fixed by each row's own length (the CPU
  runs each row as its own call over its gathered keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from batchd.engine import fused
from batchd.engine.attention import attend_lane_cpu
from batchd.engine.linear import CPU_INVARIANT_ROWS, project_rows_cpu
from batchd.kernels.paged_attention import paged_decode_attention
from batchd.kernels.paged_attention.reference import gather_rows
from batchd.kernels.rms_norm import rms_norm
from batchd.kernels.rope_paged import rope_paged_store
from batchd.kernels.silu_mul import silu_mul as silu_mul_kernel


@dataclass
class RowBatch:
    """N positions to compute, each of one sequence, on the model's device.

    tokens, positions: [N] long; block_tables: [N, max_blocks] int32 (the row's sequence's table,
    padded with any block); seq_lens: [N] int32 = position + 1 (the keys the row sees, its own
    included); write_blocks, write_offsets: [N] long, where the row's key and value go;
    max_seq_len: a bound on seq_lens (it sizes the attention grid, never a row's arithmetic)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    max_seq_len: int

    @classmethod
    def derive(cls, tokens, positions, block_tables, block_size: int, max_seq_len: int) -> "RowBatch":
        """The rest from tokens, positions and tables, on the device (inside a CUDA graph too)."""
        write_blocks = block_tables.gather(1, (positions // block_size)[:, None]).squeeze(1).long()
        return cls(tokens, positions, block_tables, (positions + 1).to(torch.int32), write_blocks,
                   positions % block_size, max_seq_len)


def project_invariant(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], slab_rows: Optional[int],
                      layer=None) -> torch.Tensor:
    """x: [N, K] -> [N, Nout]; row n's bits do not depend on N or on the other rows (slab_rows
    None on CUDA: one library GEMM of N rows, whose kernel choice, and so a row's bits, follow N)."""
    if slab_rows is None and x.device.type == "cuda":
        return F.linear(x, weight, bias)
    if x.device.type == "cpu":
        parts = [project_rows_cpu(x[i : i + CPU_INVARIANT_ROWS], layer) for i in range(0, x.shape[0], CPU_INVARIANT_ROWS)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    return project_slabs(x, weight, bias, slab_rows)


def project_slabs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], slab_rows: int) -> torch.Tensor:
    """x: [N, K] -> [N, Nout] in GEMMs of exactly `slab_rows` rows, the last one zero-padded: the
    library sees one shape only, so it picks one kernel, and a row's bits follow from its own
    values, never from N or from the rows packed beside it. Each slab writes its rows of the
    output in place (a concatenation would copy every output once more)."""
    n, k = x.shape
    padded = -(-n // slab_rows) * slab_rows
    if padded != n:
        x = torch.cat([x, x.new_zeros(padded - n, k)])
    out = x.new_empty(padded, weight.shape[0])
    w = weight.t()
    for i in range(0, padded, slab_rows):
        if bias is None:
            torch.mm(x[i : i + slab_rows], w, out=out[i : i + slab_rows])
        else:
            torch.addmm(bias, x[i : i + slab_rows], w, out=out[i : i + slab_rows])
    return out[:n]


def norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)[0]


def add_norm_rows(added: Optional[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor, eps: float):
    """(norm(hidden + added), hidden + added) in one launch on CUDA (kernels.rms_norm's residual
    form: the add rounds as `hidden + added` does); added None: (norm(hidden), hidden)."""
    if added is None:
        return norm_rows(hidden, weight, eps), hidden
    return rms_norm(added, weight, eps, residual=hidden)


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(gate) * up [N, I]: one launch on CUDA (kernels.silu_mul, which rounds as
    eager `F.silu(gate) * up` does), the eager ops on the CPU."""
    return silu_mul_kernel(gate_up) if gate_up.is_cuda else fused.silu_mul(gate_up)


def rope_and_write_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache, layer: int, write_blocks: torch.Tensor, write_offsets: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D], k and v [N, Hkv, D]; cos, sin [N, 1, D] float32 -> rotated q [N, Hq, D], with the
    rotated k and v written to the pool at (write_blocks[n], write_offsets[n]) ([N] long each). One
    launch on CUDA (kernels.rope_paged, which rounds as the eager ops do), the eager ops on the CPU."""
    if q.is_cuda:
        return rope_paged_store(q, k, v, cos, sin, cache.keys[layer], cache.values[layer], write_blocks,
                                write_offsets)
    q, k = fused.rotate(q, cos, sin), fused.rotate(k, cos, sin)
    cache.write(layer, k, v, write_blocks, write_offsets)
    return q


def attend_rows(q: torch.Tensor, cache, layer: int, rows: RowBatch, scale: float) -> torch.Tensor:
    """q: [N, Hq, D] -> [N, Hq, D], each row over its own sequence's first seq_lens[n] positions."""
    keys, values = cache.keys[layer], cache.values[layer]
    if q.device.type == "cuda":
        return paged_decode_attention(q.to(keys.dtype), keys, values, rows.block_tables, rows.seq_lens, scale=scale,
                                      max_seq_len=rows.max_seq_len).to(q.dtype)
    out = torch.empty_like(q)
    lengths = rows.seq_lens.tolist()
    for n, length in enumerate(lengths):
        k = gather_rows(keys, rows.block_tables[n], length)[None]     # [1, Hkv, S, D]
        v = gather_rows(values, rows.block_tables[n], length)[None]
        out[n] = attend_lane_cpu(q[n][None, :, None].to(k.dtype), k, v, scale)[0, :, 0].to(q.dtype)
    return out


@torch.inference_mode()
def forward_rows(model, cache, rows: RowBatch, *, slab_rows: Optional[int]) -> torch.Tensor:
    """Write each row's key and value into the pool and return every row's next-token logits
    ([N, V] float32)."""
    config = model.config
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    hidden = model.embed_tokens(rows.tokens)                                  # [N, H]
    # rows as the leading axis: cos, sin [N, 1, D] broadcast over the heads
    cos, sin = model.rope_cos[rows.positions][:, None], model.rope_sin[rows.positions][:, None]
    added = None   # the last sublayer's output [N, H], added to `hidden` by the next norm's kernel
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        x, hidden = add_norm_rows(added, hidden, layer.input_layernorm.weight, layer.input_layernorm.eps)
        qkv = project_invariant(x, attn.qkv_proj.weight, attn.qkv_proj.bias, slab_rows, attn.qkv_proj)
        q, k, v = qkv.split(attn.split_sizes, dim=-1)
        q, k, v = q.view(-1, Hq, D), k.view(-1, Hkv, D), v.view(-1, Hkv, D)
        if attn.q_norm is not None:  # qwen3: per-head norms before rope
            q = norm_rows(q.reshape(-1, D), attn.q_norm.weight, attn.q_norm.eps).view(-1, Hq, D)
            k = norm_rows(k.reshape(-1, D), attn.k_norm.weight, attn.k_norm.eps).view(-1, Hkv, D)
        q = rope_and_write_rows(q, k, v, cos, sin, cache, i, rows.write_blocks, rows.write_offsets)
        out = attend_rows(q, cache, i, rows, attn.scale).reshape(-1, Hq * D)
        added = project_invariant(out, attn.o_proj.weight, None, slab_rows, attn.o_proj)
        post = layer.post_attention_layernorm
        x, hidden = add_norm_rows(added, hidden, post.weight, post.eps)
        mlp = layer.mlp
        gate_up = project_invariant(x, mlp.gate_up_proj.weight, None, slab_rows, mlp.gate_up_proj)
        added = project_invariant(silu_mul_rows(gate_up), mlp.down_proj.weight, None, slab_rows, mlp.down_proj)
    normed, _ = add_norm_rows(added, hidden, model.norm.weight, model.norm.eps)
    return project_invariant(normed, model.lm_head.weight, None, slab_rows, model.lm_head).float()
