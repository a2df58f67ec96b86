"""DeepSeek V4's hyper-connection mixing (engine.deepseek_v4.hyper_connections), one launch each on
CUDA where eager torch takes about 130 (split) and 40 (merge) tiny kernels per block.

    post, comb, x = hc_split(mixes, scale, base, streams, iters, eps)   # before attention / MoE
    streams = hc_merge(streams, block_out, post, comb)                   # after it

mixes [..., (2 + n) n] float32, scale [3], base [(2 + n) n], streams [..., n, H], block_out [..., H];
post [..., n] and comb [..., n, n] float32, x [..., H] in the streams' dtype. Each token row is one
program: a row's bits are the same whatever rows share the launch.
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.hyper_connection.reference import (collapse_reference, hc_merge_reference, hc_split_reference,
                                                        sinkhorn_reference)

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def hc_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: torch.Tensor, iters: int,
             eps: float, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    *lead, n, H = streams.shape
    if mixes.shape != (*lead, (2 + n) * n) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        raise ValueError(f"mixes {list(mixes.shape)}, base {list(base.shape)}, scale {list(scale.shape)} do not fit "
                         f"{n} streams: want [..., {(2 + n) * n}], [{(2 + n) * n}], [3]")
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    if resolve_backend(backend, streams.device) == "reference" or streams.dtype not in KERNEL_DTYPES:
        return hc_split_reference(mixes, scale, base, streams, iters, eps)
    from batchd.kernels.hyper_connection.triton_kernel import hc_split_triton

    post, comb, x = hc_split_triton(mixes.float().reshape(-1, (2 + n) * n), scale.float().contiguous(),
                                    base.float().contiguous(), streams.reshape(-1, n, H).contiguous(), iters, eps)
    return post.view(*lead, n), comb.view(*lead, n, n), x.view(*lead, H)


def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
             backend: str = "auto") -> torch.Tensor:
    *lead, n, H = streams.shape
    if block_out.shape != (*lead, H) or post.shape != (*lead, n) or comb.shape != (*lead, n, n):
        raise ValueError(f"block_out {list(block_out.shape)}, post {list(post.shape)}, comb {list(comb.shape)} "
                         f"do not fit streams {list(streams.shape)}")
    if resolve_backend(backend, streams.device) == "reference" or streams.dtype not in KERNEL_DTYPES \
            or block_out.dtype != streams.dtype:
        return hc_merge_reference(streams, block_out, post, comb)
    from batchd.kernels.hyper_connection.triton_kernel import hc_merge_triton

    out = hc_merge_triton(streams.reshape(-1, n, H).contiguous(), block_out.reshape(-1, H).contiguous(),
                          post.float().reshape(-1, n).contiguous(), comb.float().reshape(-1, n, n).contiguous())
    return out.view(*lead, n, H)


__all__ = ["collapse_reference", "hc_merge", "hc_merge_reference", "hc_split", "hc_split_reference",
           "sinkhorn_reference"]
