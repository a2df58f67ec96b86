"""PyTorch twin of the hyper-connection kernels: what engine.deepseek_v4.hyper_connections computes,
in the same float32 steps and roundings."""
from __future__ import annotations

import torch


def hc_split_reference(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: torch.Tensor,
                       iters: int, eps: float, sigmoid=torch.sigmoid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [N, (2 + n) n] float32 (pre, post, comb logits), scale [3], base [(2 + n) n], streams
    [N, n, H] -> (post [N, n] float32, comb [N, n, n] float32, the block input [N, H] in the streams' dtype):

        pre  = sigmoid(pre_w s0 + b) + eps            post = 2 sigmoid(post_w s1 + b)
        comb = sinkhorn(softmax(comb_w s2 + b) + eps)  x    = sum_j pre_j streams_j (float32, rounded once)

    `sigmoid`: the engine's CPU row step passes one applied row by row (engine.deepseek_v4.rows.per_row).
    """
    n = streams.shape[-2]
    pre_w, post_w, comb_w = mixes.float().split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = sinkhorn_reference(comb, iters, eps)
    return post, comb, collapse_reference(pre, streams)


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] positive -> nearly doubly stochastic: columns, then rows and columns iters - 1 times."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def collapse_reference(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """pre [..., n] float32, streams [..., n, H] -> sum_j pre_j streams_j [..., H], summed in float32
    stream by stream and rounded once to the streams' dtype."""
    pre = pre.float().unsqueeze(-1)
    return sum(pre[..., j, :] * streams[..., j, :] for j in range(streams.shape[-2])).to(streams.dtype)


def hc_merge_reference(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                       comb: torch.Tensor) -> torch.Tensor:
    """streams [..., n, H], block_out [..., H], post [..., n], comb [..., n, n] (float32) -> the next
    streams [..., n, H]: stream i = post_i block_out + sum_j comb_ji streams_j, where the product
    post_i block_out is formed in the streams' dtype and the mix summed in float32, rounded once."""
    dtype = streams.dtype
    comb = comb.float()
    mixed = sum(comb[..., j, :, None] * streams[..., j : j + 1, :].float() for j in range(streams.shape[-2]))
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed.to(dtype)
