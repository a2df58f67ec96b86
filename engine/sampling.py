"""Token selection: greedy, temperature, top-k, top-p, seeded.

`Sampler.probabilities` exposes the filtered distribution so that speculative rejection
sampling compares the very distributions that plain sampling draws from.
"""
from __future__ import annotations

import torch

from batchd.engine.errors import BadInputError
from batchd.engine.types import SamplingParams


def validate_sampling(params: SamplingParams) -> None:
    if params.max_new_tokens < 1:
        raise BadInputError(f"max_new_tokens must be at least 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise BadInputError(f"temperature must be >= 0 (0 is greedy), got {params.temperature}")
    if params.top_k < 0:
        raise BadInputError(f"top_k must be >= 0 (0 disables it), got {params.top_k}")
    if not 0.0 < params.top_p <= 1.0:
        raise BadInputError(f"top_p must be in (0, 1], got {params.top_p}")


class Sampler:
    def __init__(self, params: SamplingParams, device):
        validate_sampling(params)
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [..., V] float32 -> probabilities [..., V] after temperature, top-k, top-p."""
        p = self.params
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # drop a token when the tokens ranked above it already hold top_p of the mass
            drop_sorted = sorted_probs.cumsum(-1) - sorted_probs > p.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(-1)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [..., V] -> token ids [...] (long), on the logits' device, no host sync."""
        if self.greedy:
            return logits.argmax(-1)
        return self.draw(self.probabilities(logits))

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """probs: [..., V] -> ids [...] drawn with this job's seeded generator."""
        flat = probs.reshape(-1, probs.shape[-1])
        ids = torch.multinomial(flat, 1, generator=self.generator).squeeze(-1)
        return ids.reshape(probs.shape[:-1])

    def uniform(self, shape, device) -> torch.Tensor:
        """Uniform [0, 1) draws from the same seeded stream (rejection sampling's coin flips)."""
        return torch.rand(shape, generator=self.generator, device=device)
