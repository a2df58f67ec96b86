"""Weights into L2 ahead of the kernel that reads them: the decode step's idle DRAM put to work.

At batch 1 a decode layer is a chain of dependent launches (qkv, attention split and merge, o,
gate/up, down and its reduce), and DRAM idles between the projections: attention reads little at
short context, and every small projection has a ramp and a tail of a microsecond or two. Weights
depend on nothing, so a kernel can ask for a *later* kernel's weight bytes the moment its programs
start; that later kernel then finds them in L2 (60 MB on the H200) instead of waiting on DRAM.

    prefetch = weight_range(w_gate_up, 0, 16 << 20)    # host: a byte view of the weight
    small_linear(..., prefetch=prefetch)              # each program requests its share

The request is Hopper's `cp.async.bulk.prefetch.L2.global`: one instruction per contiguous range,
issued by each thread for its slice, with no registers, no wait and no effect on any value: the
output is the same, bit for bit, with or without it. Only compiled kernels on sm_90+ issue it
(`prefetch_enabled`); elsewhere the host passes no range and the kernels compile it out.
This module imports no triton; the kernels' helper is `triton_kernel.prefetch_l2`.
"""
from __future__ import annotations

import torch

from kernels._backend import interpreting

GRANULE = 16          # bytes: the bulk prefetch's alignment and size unit


def prefetch_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` can issue the bulk L2 prefetch (compiled, compute capability 9+)."""
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def weight_range(weight: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor | None:
    """Bytes [start, stop) of a contiguous tensor as a uint8 view (None when empty). Both ends are
    rounded down to GRANULE, so the view is aligned and its size a multiple of GRANULE."""
    if not weight.is_contiguous():
        raise ValueError(f"an L2 prefetch range needs a contiguous tensor, got strides {weight.stride()}")
    flat = weight.reshape(-1).view(torch.uint8)
    total = flat.numel() - flat.numel() % GRANULE
    start = min(start - start % GRANULE, total)
    stop = total if stop is None else min(stop - stop % GRANULE, total)
    if stop <= start:
        return None
    if flat.data_ptr() % GRANULE:
        raise ValueError(f"an L2 prefetch range must start {GRANULE}-byte aligned")
    return flat[start:stop]


def prefetch_args(prefetch: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(pointer, bytes, PREFETCH) kernel arguments for an optional range from `weight_range`."""
    if prefetch is None or not prefetch_enabled(prefetch.device):
        return fallback, 0, False
    if prefetch.dtype != torch.uint8 or prefetch.dim() != 1 or prefetch.numel() % GRANULE \
            or prefetch.data_ptr() % GRANULE:
        raise ValueError("prefetch must be a range from kernels.l2_prefetch.weight_range")
    return prefetch, prefetch.numel(), True


__all__ = ["weight_range", "prefetch_args", "prefetch_enabled", "GRANULE"]
