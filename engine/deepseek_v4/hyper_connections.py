"""Manifold-constrained hyper-connections (mHC, paper §2.2): the residual is `hc_mult` streams.

Around each attention and MoE block, a small projection of the (normed, flattened) streams gives
three mixes per token: `pre` [n] collapses the streams into the block's input, `post` [n] spreads
the block's output back over them, and `comb` [n, n], projected onto doubly-stochastic matrices by
Sinkhorn-Knopp, mixes the incoming streams into the outgoing ones:

    streams' = post ⊗ block(sum_j pre_j streams_j) + combᵀ streams

The mixes' projection goes through engine.deepseek_v4.rows.linear. On CUDA the rest is one launch
each side of the block (kernels.hyper_connection: a program per token row, where eager torch
launched about 170 tiny kernels a block, Sinkhorn's 20 iterations 117 of them); elsewhere the
kernels' twins (sums over streams written out stream by stream, elementwise, so a row's bits never
depend on the others), with the sigmoids one call per row in a CPU row step (rows.per_row).
"""
from __future__ import annotations

import torch
from torch import nn

from batchd.engine.deepseek_v4.config import V4Config
from batchd.engine.deepseek_v4.norms import rms_normalize
from batchd.engine.deepseek_v4.rows import linear, per_row
from batchd.kernels.hyper_connection import collapse_reference as collapse
from batchd.kernels.hyper_connection import hc_merge, hc_split, hc_split_reference


class HyperConnection(nn.Module):
    """fn [(2 + n) n, n H], base [(2 + n) n], scale [3] (pre, post, comb)."""

    def __init__(self, config: V4Config):
        super().__init__()
        n = config.hc_mult
        self.iters, self.hc_eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, n, H] -> (post [B, T, n], comb [B, T, n, n], the block input [B, T, H])."""
        mixes = linear(rms_normalize(streams.flatten(2), self.norm_eps), self.fn.float())
        if streams.is_cuda:
            return hc_split(mixes, self.scale, self.base, streams, self.iters, self.hc_eps)
        return hc_split_reference(mixes, self.scale, self.base, streams, self.iters, self.hc_eps,
                                  sigmoid=lambda x: per_row(torch.sigmoid, x))

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """streams [B, T, n, H], block_out [B, T, H] -> the next streams [B, T, n, H]: post ⊗ block_out
        formed in the streams' dtype, plus combᵀ streams summed in float32 and rounded once (as a
        matmul's accumulator)."""
        return hc_merge(streams, block_out, post, comb)


class HyperHead(nn.Module):
    """The final collapse of the streams before the model's norm: hc_fn [n, n H], hc_base [n], hc_scale [1]."""

    def __init__(self, config: V4Config):
        super().__init__()
        n = config.hc_mult
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [B, T, n, H] -> [B, T, H]."""
        mixes = linear(rms_normalize(streams.flatten(2), self.norm_eps), self.hc_fn.float())
        pre = per_row(torch.sigmoid, mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return collapse(pre, streams)
