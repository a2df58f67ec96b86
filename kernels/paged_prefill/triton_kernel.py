"""Triton kernel of paged prefill attention: one program per (query tile of a chunk, query head),
flash-style over the chunk's sequence's key blocks from position 0, in block order.

A tile holds BLOCK_M consecutive rows of one chunk, counted from the chunk's first row; it reads
key blocks up to the last position its rows see. A row's extra blocks (those only later rows of
its tile see) are fully masked for it and leave its running max, sum and accumulator unchanged,
so a row's bits do not depend on which rows share its tile, nor on the other chunks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import interpreting, patch_interpreter_index

if interpreting():
    patch_interpreter_index()

BLOCK_M = 64


@triton.jit
def _paged_prefill_kernel(Q, K, V, Out, Tables, RowStarts, ChunkRows, FirstPositions, TileChunk, TileRow0, scale,
                          stride_qn, stride_qh, stride_on, stride_oh, stride_kb, stride_kh, stride_ks, stride_tc,
                          G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                          BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.load(TileChunk + tile)
    row0 = tl.load(TileRow0 + tile)
    row_start = tl.load(RowStarts + chunk)
    rows = tl.load(ChunkRows + chunk)
    first = tl.load(FirstPositions + chunk)
    kv_head = head // G
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DP)
    offs_s = tl.arange(0, BS)
    live = offs_m < rows
    d_ok = offs_d < D
    dot_dtype = tl.float32 if UPCAST else K.dtype.element_ty
    q = tl.load(Q + (row_start + offs_m).to(tl.int64)[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                mask=live[:, None] & d_ok[None, :], other=0.0).to(dot_dtype)
    position = first + offs_m                                              # [BLOCK_M] each row's position
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    last = first + tl.minimum(row0 + BLOCK_M, rows)                        # keys this tile needs: [0, last)
    for b in range(0, tl.cdiv(last, BS)):
        block = tl.load(Tables + chunk * stride_tc + b)
        kv = block.to(tl.int64) * stride_kb + kv_head * stride_kh + offs_s[:, None] * stride_ks + offs_d[None, :]
        k = tl.load(K + kv, mask=d_ok[None, :], other=0.0)                 # [BS, DP]
        s = tl.dot(q, tl.trans(k.to(dot_dtype)), input_precision=PRECISION) * scale   # [BLOCK_M, BS] float32
        s = tl.where((b * BS + offs_s)[None, :] <= position[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + kv, mask=d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(dot_dtype), v.to(dot_dtype), input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    tl.store(Out + (row_start + offs_m).to(tl.int64)[:, None] * stride_on + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=live[:, None] & d_ok[None, :])


def query_tiles(chunk_rows: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(chunk of each tile, first row of each tile within its chunk): tiles from each chunk's row 0."""
    chunks, firsts = [], []
    for c, rows in enumerate(chunk_rows):
        for row0 in range(0, rows, block_m):
            chunks.append(c), firsts.append(row0)
    return chunks, firsts


def paged_prefill_attention_triton(q, k_pool, v_pool, block_tables, row_starts, chunk_rows, first_positions, *,
                                   scale: float, host_chunk_rows: list[int] | None = None, block_m: int = BLOCK_M,
                                   num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """`host_chunk_rows`: chunk_rows as a list, when the caller has it (spares a device read)."""
    N, Hq, D = q.shape
    _, Hkv, BS, _ = k_pool.shape
    out = torch.empty_like(q)
    if N == 0:
        return out
    if not k_pool.is_contiguous() or not v_pool.is_contiguous():
        raise ValueError("k_pool and v_pool must be contiguous [blocks, Hkv, block_size, D]")
    q = q.contiguous()
    chunks, firsts = query_tiles(host_chunk_rows if host_chunk_rows is not None else chunk_rows.tolist(), block_m)
    tiles = torch.tensor([chunks, firsts], dtype=torch.int32).to(q.device, non_blocking=True)
    _paged_prefill_kernel[(len(chunks), Hq)](
        q, k_pool, v_pool, out, block_tables, row_starts, chunk_rows, first_positions, tiles[0], tiles[1], scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0),
        G=Hq // Hkv, D=D, DP=triton.next_power_of_2(D), BS=BS, BLOCK_M=block_m, UPCAST=interpreting(),
        PRECISION="ieee" if k_pool.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
