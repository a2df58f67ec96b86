"""V4's mixture of experts (paper §2.1): routed experts plus one shared expert, every layer.

A router picks `experts_per_token` experts per token and weighs them: learned top-k of
score(x W_gate) + a correction bias (the bias only chooses, never weighs), or, in the first
`hash_moe` layers, a frozen token id -> experts table (`tid2eid`) with the same learned weights.
Weights are normalised over the chosen experts and scaled by `routed_scaling_factor`. Experts and
the shared one are SwiGLU MLPs with clamped pre-activations (`swiglu_limit`).

On CUDA the routed experts run as one grouped GEMM (kernels.moe_experts: tokens grouped by expert,
only the chosen experts' weights read, a token's output independent of the batch); elsewhere as
the loop over experts below, which the kernel's reference twin restates token by token; the loop
multiplies an expert's tokens through engine.deepseek_v4.rows.linear, so at up to 17 tokens each
token's product is what it gets alone (and a token's experts are added in expert order either way).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchd.engine.deepseek_v4.config import V4Config
from batchd.engine.deepseek_v4.rows import RowLinear, linear, per_row
from batchd.kernels.moe_experts import clamped_swiglu, moe_experts

SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


class Router(nn.Module):
    """weight [E, H]; hashed: tid2eid [V, k] picks the experts; else e_score_correction_bias [E]."""

    def __init__(self, config: V4Config, hashed: bool):
        super().__init__()
        self.hashed, self.top_k = hashed, config.experts_per_token
        self.score = SCORE_FUNCTIONS[config.scoring_func]
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H], token_ids [N] -> (weights [N, k], expert ids [N, k])."""
        scores = per_row(self.score, linear(x, self.weight))                                 # [N, E]
        if self.hashed:
            experts = self.tid2eid[token_ids].long()
        else:
            # sorted: slot = rank, so the kernel's slot-ordered sum of a token's experts is one order
            # whatever the batch (unsorted top-k's order may follow the algorithm the batch size picks)
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class Experts(nn.Module):
    """gate_up_proj [E, 2I, H] (gate rows then up rows), down_proj [E, H, I]."""

    def __init__(self, config: V4Config):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.limit = config.swiglu_limit
        self.backend: str | None = None   # None: the grouped kernel on CUDA, the loop elsewhere;
                                          # "triton" forces the kernel (the CPU under TRITON_INTERPRET=1)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights / experts [N, k] -> the weighted sum of each token's experts [N, H]."""
        if self.backend is not None or (x.is_cuda and x.dtype == self.down_proj.dtype):
            return moe_experts(x, weights, experts, self.gate_up_proj, self.down_proj, self.limit,
                               backend=self.backend or "auto")
        return self.loop_over_experts(x, weights, experts)

    def loop_over_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The plain torch path: tokens grouped by expert, so each expert's weights are read once per
        step; a token's k products are added as their experts come up."""
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            token, slot = torch.where(experts == expert)
            y = linear(per_row(self._swiglu, linear(x[token], self.gate_up_proj[expert])), self.down_proj[expert])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[M, 2I] gate then up -> [M, I]."""
        return clamped_swiglu(*gate_up.chunk(2, dim=-1), self.limit)


class SharedExpert(nn.Module):
    def __init__(self, config: V4Config):
        super().__init__()
        H, I = config.hidden_size, config.moe_intermediate_size
        self.gate_proj = RowLinear(H, I, bias=False)
        self.up_proj = RowLinear(H, I, bias=False)
        self.down_proj = RowLinear(I, H, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(per_row(lambda rows: clamped_swiglu(*rows.chunk(2, dim=-1), self.limit), gate_up))


class MoE(nn.Module):
    def __init__(self, config: V4Config, layer: int):
        super().__init__()
        self.gate = Router(config, hashed=config.mlp_layer_types[layer] == "hash_moe")
        self.experts = Experts(config)
        self.shared_experts = SharedExpert(config)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [B, T, H], token_ids [B, T] (hash routing reads them) -> [B, T, H]."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat, token_ids.reshape(-1))
        return self.experts(flat, weights, experts).view_as(x) + self.shared_experts(x)
