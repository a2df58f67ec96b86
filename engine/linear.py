"""Projections whose rows do not depend on how many rows are computed together.

Greedy output must be bit-identical with speculation on or off, yet plain decode multiplies one
row (M = 1) and fused verification q + 1 rows. BLAS libraries pick a kernel per M (cuBLAS; MKL's
sgemv for M = 1 and sgemm tiles beyond), so the same row comes out different in the last bits and
an argmax can flip. Every step of up to 17 rows (decode, and verify of up to 16 drafts) therefore
runs through a kernel whose per-row result is independent of M; prefill chunks, the same in both
paths, use the library's GEMM.

- CUDA: `kernels.small_matmul` (also faster than cuBLAS at these shapes), the model's
  `KernelChoice.small_linear` (engine.fused).
- CPU: oneDNN's inner product over a weight reordered once into its blocked layout
  (`torch.ops.mkldnn._linear_pointwise`, the op Inductor uses for frozen linears). Its rows are
  independent of M from 1 to 17, so a verify step of q + 1 rows costs about what one GEMM of
  q + 1 rows costs, not q + 1 decode steps. That is measured, not promised by oneDNN: the first
  use of each (shape, dtype, bias, threads) checks it on random rows (`_rows_are_invariant`). Where
  it fails, and for tiny weights, a float32 step runs as one batched call of one-row products
  (`batched_one_row_products`, a bmm), again only where the same kind of check finds its rows
  equal to one-row F.linear (`_batched_rows_are_invariant`): on a 16-thread Xeon (torch 2.11) they
  were not, at N = 256, K = 64 (MKL splits one product over its threads, a batch over its items).
  Everything else, bf16/f16 steps among it (`_pack` says why), runs each row as the very call a
  one-row decode step makes (`one_row_products`: invariant by construction, but q + 1 calls).
"""
from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

MAX_INVARIANT_ROWS = 17  # CUDA: 16 drafts plus the last accepted token (kernels.small_matmul takes 32)
CPU_INVARIANT_ROWS = 17  # the widest verify step: 16 draft tokens plus the last accepted one
# Smaller weights take the one-row products: there oneDNN's per-call overhead (and its threads'
# wake-ups) costs more than the q + 1 products (a 64-wide test model runs 1.5-2x slower)
ONEDNN_MIN_WEIGHTS = 1 << 16


def project(x: torch.Tensor, layer: nn.Linear, small_linear=None) -> torch.Tensor:
    """x: [B, T, K] -> [B, T, N] through `layer`'s weight and bias. `small_linear`: the model's
    invariant CUDA kernel (`KernelChoice.small_linear`, kernels.small_matmul), or None."""
    rows = x.shape[0] * x.shape[1]
    if small_linear is not None and x.is_cuda and rows <= MAX_INVARIANT_ROWS:
        out = small_linear(x.reshape(rows, x.shape[-1]), layer.weight, layer.bias)
        return out.view(*x.shape[:-1], -1)
    if x.device.type == "cpu" and rows <= CPU_INVARIANT_ROWS:
        return project_rows_cpu(x.reshape(rows, x.shape[-1]), layer).view(*x.shape[:-1], -1)
    return F.linear(x, layer.weight, layer.bias)


def project_rows_cpu(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x: [M, K], M <= 17 -> [M, N]; row i is the same for every M (a decode step is M = 1).
    `layer`: an nn.Linear (its weight packed once for oneDNN where that is invariant), or any
    object with `weight` and `bias` (a slice of a stacked weight: one-row products)."""
    packed = packed_weight(layer) if isinstance(layer, nn.Module) else None
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
    if x.shape[0] > 1 and x.dtype == torch.float32 and _batched_rows_are_invariant(layer.weight, layer.bias):
        return batched_one_row_products(x, layer)
    return one_row_products(x, layer)


def one_row_products(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x: [M, K] -> [M, N], each row through one F.linear of one row: the call a decode step (M = 1)
    makes, on a 64-byte aligned copy (a SIMD kernel may split its sums by the address), so a row's
    bits cannot depend on M, whatever kernel or thread split the BLAS library picks for the call."""
    if x.shape[0] == 1:
        return F.linear(_aligned(x), layer.weight, layer.bias)
    return torch.cat([F.linear(_aligned(x[i : i + 1]), layer.weight, layer.bias) for i in range(x.shape[0])])


def batched_one_row_products(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x: [M, K] -> [M, N] as M one-row products in one bmm over a stride-0 view of the weight:
    1.5-5x faster than M calls at SmolLM2's down and at tiny test weights (2-core EPYC), and its
    rows equal one-row F.linear's where `_batched_rows_are_invariant` says so, not everywhere."""
    M = x.shape[0]
    weight = layer.weight.t().unsqueeze(0).expand(M, -1, -1)  # [M, K, N], a view
    x = _aligned(x.contiguous()).unsqueeze(1)  # [M, 1, K]
    if layer.bias is None:
        return torch.bmm(x, weight).squeeze(1)
    return torch.baddbmm(layer.bias.view(1, 1, -1).expand(M, 1, -1), x, weight).squeeze(1)


def _aligned(row: torch.Tensor) -> torch.Tensor:
    return row if row.data_ptr() % 64 == 0 else row.clone()


def rows_are_invariant(layer: nn.Linear) -> bool:
    """Whether small CPU steps through `layer` run as one oneDNN product (else one-row products)."""
    return packed_weight(layer) is not None


# layer -> ((weight data_ptr, version), oneDNN-packed weight or None where oneDNN is not invariant)
_packed: "weakref.WeakKeyDictionary[nn.Linear, tuple]" = weakref.WeakKeyDictionary()
# (route, N, K, dtype, bias?, threads) -> whether that route's rows were found independent of M
_invariant: dict[tuple, bool] = {}


def packed_weight(layer: nn.Linear):
    """`layer`'s weight in oneDNN's layout (an opaque mkldnn tensor, packed once and kept while
    the weight is unchanged), or None where the oneDNN path is not row-invariant."""
    weight = layer.weight
    key = (weight.data_ptr(), _version(weight))
    cached = _packed.get(layer)
    if cached is None or cached[0] != key:
        packed = _pack(weight)
        if packed is not None and not _rows_are_invariant(packed, weight, layer.bias):
            packed = None
        cached = (key, packed)
        _packed[layer] = cached
    return cached[1]


def _pack(weight: torch.Tensor):
    # float32 only: a bf16/f16 product rounds its float32 sums to 8 or 11 bits, which hides an
    # M-dependent summation order from the random-row check below almost always (on an
    # AVX512-BF16 CPU it passed, then rows differed at M = 9 on other data), so reduced precision
    # takes `one_row_products`, which are invariant by construction
    if (weight.dtype != torch.float32 or weight.numel() < ONEDNN_MIN_WEIGHTS
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError:  # a build or CPU whose oneDNN cannot reorder this weight
        return None


def _rows_are_invariant(packed, weight: torch.Tensor, bias) -> bool:
    """Whether oneDNN's product over the packed weight gives every row of M = 2..17 rows exactly
    as it gives that row alone."""
    run = lambda rows, b: torch.ops.mkldnn._linear_pointwise(rows, packed, b, "none", [], "")  # noqa: E731
    return _rows_match_alone("onednn", weight, bias, run,
                             lambda x, b: torch.cat([run(x[i : i + 1], b) for i in range(x.shape[0])]))


def _batched_rows_are_invariant(weight: torch.Tensor, bias) -> bool:
    """Whether `batched_one_row_products` gives, for M = 2..17 rows, exactly the rows of
    `one_row_products`."""
    layer = lambda b: SimpleNamespace(weight=weight, bias=b)  # noqa: E731
    return _rows_match_alone("bmm", weight, bias, lambda rows, b: batched_one_row_products(rows, layer(b)),
                             lambda x, b: one_row_products(x, layer(b)))


def _rows_match_alone(route: str, weight: torch.Tensor, bias, batched, alone) -> bool:
    """Whether batched(x[:M], b) == alone(x, b)[:M] for M = 2..17 on random rows x and bias b,
    checked once per (route, shape, dtype, bias?, threads): a kernel's summation order does not
    depend on the values, so random rows expose any M-dependent order."""
    N, K = weight.shape
    key = (route, N, K, weight.dtype, bias is not None, torch.get_num_threads())
    if key not in _invariant:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(CPU_INVARIANT_ROWS, K, generator=g).to(weight.dtype)
        b = None if bias is None else torch.randn(N, generator=g).to(bias.dtype)
        with torch.no_grad():
            rows_alone = alone(x, b)
            _invariant[key] = all(torch.equal(batched(x[:M], b), rows_alone[:M])
                                  for M in range(2, CPU_INVARIANT_ROWS + 1))
    return _invariant[key]


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return 0
