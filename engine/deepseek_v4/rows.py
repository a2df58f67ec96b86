"""V4's row-invariant path: a step of up to 17 rows computes every row as it would alone.

Greedy output must not change with speculation on or off, yet a decode step computes one row and a
verify step 1 + q rows; in bf16 a GEMM of M = 2 rounds a row apart from the same row at M = 1
(docs/deepseek_v4.md, issue 37). So every step of at most `ROW_STEP` rows (decode, verify of up to
16 drafts, a short prompt tail) takes, wherever a library's arithmetic may follow the row count:
- projections: `linear`; on CUDA one cuBLAS GEMM of exactly CUDA_ROW_SLAB rows (`padded_rows`: one
  shape, so one kernel, and a row's bits follow from its own values, as the dense engine's slabs);
  on the CPU engine.linear's row-invariant path (oneDNN where checked invariant, else one-row products);
- row reductions (norms): on CUDA kernels.rms_norm.rms_norm_f32, one program a row
  (engine.deepseek_v4.norms); elsewhere `mean_square`, one call per row where a multi-threaded
  CPU above its grain would split them by the row count;
- transcendental elementwise functions (sigmoid, softplus, silu) on the CPU: `per_row`, since a
  vectorised kernel computes a tensor's tail elements with scalar code whose exp rounds apart
  (found: a hyper-connection's sigmoid over 17 rows x 2 streams differed from one row's);
- attention, the grouped projection, the indexer's scores and top-k, the compressor's entries and
  the MoE loop: per row or per window in their modules (attention.py, compressor.py, moe.py).
Longer pieces (prompt chunks, replays) are the same in both paths and take the library's GEMMs.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchd.engine.linear import CPU_INVARIANT_ROWS, MAX_INVARIANT_ROWS, project_rows_cpu

ROW_STEP = min(CPU_INVARIANT_ROWS, MAX_INVARIANT_ROWS)  # 16 drafts plus the last accepted token
CPU_REDUCTION_GRAIN = 32768  # at::internal::GRAIN_SIZE: smaller reductions run on one thread
# a CUDA row step's fixed shape: every projection of up to ROW_STEP rows runs padded to this many
# rows, one cuBLAS launch (kernels.small_matmul's wrapper cost about 0.3 ms of host time a call, a
# V4 layer makes about 25, and eager V4 is bound by its host)
CUDA_ROW_SLAB = 32
assert CUDA_ROW_SLAB >= ROW_STEP


def is_row_step(rows: int) -> bool:
    return rows <= ROW_STEP


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           layer: Optional[nn.Module] = None) -> torch.Tensor:
    """x [..., K] -> [..., N]; for up to ROW_STEP rows each row's bits are what it gets alone.
    `layer`: the nn.Linear holding `weight` (the CPU packs its weight for oneDNN once), or None."""
    rows = x.numel() // x.shape[-1]
    if not is_row_step(rows) or rows == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if x.device.type == "cpu":
        out = project_rows_cpu(flat, layer if layer is not None else SimpleNamespace(weight=weight, bias=bias))
    elif x.device.type == "cuda":
        out = F.linear(padded_rows(flat), weight, bias)[:rows]
    else:  # one-row calls: the very call a decode row makes
        out = torch.cat([F.linear(flat[i : i + 1].contiguous(), weight, bias) for i in range(rows)])
    return out.view(*x.shape[:-1], -1)


def padded_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [R, ...] (R <= CUDA_ROW_SLAB) -> [CUDA_ROW_SLAB, ...], the first R these rows: one GEMM
    shape for every CUDA row step, so one kernel, and a row's bits follow from its own values. The
    padding rows are left as allocated (one copy instead of a fill and a copy): no product of a
    GEMM row reads another row, and their outputs are dropped."""
    padded = rows.new_empty(CUDA_ROW_SLAB, *rows.shape[1:])
    padded[: rows.shape[0]] = rows
    return padded


class RowLinear(nn.Linear):
    """nn.Linear whose steps of up to ROW_STEP rows go through `linear` (same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self)


def per_row(fn, x: torch.Tensor) -> torch.Tensor:
    """fn, an elementwise function, on x [..., C]; in a CPU row step one call per row, so each row
    meets the vectorised body and scalar tail of the kernel as it does alone (CUDA's elementwise
    kernels compute every element alike)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= 1 or not is_row_step(rows) or x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(rows, x.shape[-1])
    return torch.cat([fn(flat[i : i + 1].contiguous()) for i in range(rows)]).view(*x.shape[:-1], -1)


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] -> mean(x², -1) [..., 1], each row reduced as it is alone: CUDA's reduction kernels
    and a multi-threaded CPU above its grain split a reduction by how many rows there are, so a row
    step reduces one row a call there (V4's CUDA norms take kernels.rms_norm instead)."""
    rows = x.numel() // max(x.shape[-1], 1)
    splits = x.device.type != "cpu" or (torch.get_num_threads() > 1 and x.numel() >= CPU_REDUCTION_GRAIN)
    if rows <= 1 or not splits or not is_row_step(rows):
        return x.square().mean(-1, keepdim=True)
    flat = x.reshape(rows, x.shape[-1])
    return torch.cat([flat[i : i + 1].square().mean(-1, keepdim=True) for i in range(rows)]).view(*x.shape[:-1], 1)


def row_step_groups(items: list, rows_of) -> list[list]:
    """`items` in order, in groups whose rows (`rows_of(item)` each) are at most ROW_STEP together,
    so each group can be one forward on the row-invariant path; an item of more rows goes alone."""
    groups, rows = [], ROW_STEP + 1
    for item in items:
        if rows + rows_of(item) > ROW_STEP:
            groups.append([])
            rows = 0
        groups[-1].append(item)
        rows += rows_of(item)
    return groups


def segment_positions(starts: list[int], counts: list[int], device) -> torch.Tensor:
    """The positions of sequences' rows laid out one sequence after another: counts[b] rows from
    starts[b] -> [sum(counts)]."""
    return torch.tensor([p for start, count in zip(starts, counts) for p in range(start, start + count)], device=device)
