"""The token-id generation loop without speculation: prefill, then one token per step.

Phases: (1) prefill the prompt in chunks, (2) sample the first token, (3) decode step by step.
On CUDA the loop never waits for the GPU between tokens: each sampled id stays on the device and
feeds the next (graph-replayed) step; the host reads the ids back every `sync_every` steps to
check EOS, stop strings and the budget. Steps run past the end are simply discarded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.sampling import Sampler
from engine.step import StepRunner
from engine.stopping import StopChecker


@dataclass
class TokenOutput:
    token_ids: list[int]
    finish_reason: str
    prefill_s: float
    decode_s: float


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_prompt(runner: StepRunner, prompt_ids: list[int], chunk_size: int) -> torch.Tensor:
    """Prefill all prompt tokens; returns logits of the last prompt position [1, 1, V]."""
    device = runner.cache.device
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    return runner.prefill(tokens, chunk_size)


@torch.inference_mode()
def generate_plain(runner: StepRunner, prompt_ids: list[int], sampler: Sampler, stopper: StopChecker,
                   *, prefill_chunk: int = 2048, sync_every: int = 16) -> TokenOutput:
    device = runner.cache.device
    if device.type != "cuda":
        sync_every = 1
    started = time.perf_counter()
    logits = prefill_prompt(runner, prompt_ids, prefill_chunk)
    next_token = sampler.sample(logits[:, -1])  # [1]
    synchronize(device)
    prefill_s = time.perf_counter() - started

    started = time.perf_counter()
    generated: list[int] = []
    finish = decode_plain(runner, next_token, sampler, stopper, generated, sync_every=sync_every)
    return TokenOutput(generated, finish, prefill_s, time.perf_counter() - started)


def decode_plain(runner: StepRunner, next_token: torch.Tensor, sampler: Sampler, stopper: StopChecker,
                 generated: list[int], *, sync_every: int = 16) -> str:
    """Decode one token per step from `next_token` ([1] on the device: sampled, not yet fed) until
    a stop rule applies; appends to `generated` and returns the finish reason. Also the fallback of
    speculative decoding once it switches itself off (engine.speculative)."""
    device = runner.cache.device
    if device.type != "cuda":
        sync_every = 1
    pending = [next_token]  # device ids not yet read back by the host
    chain = sampler.greedy and runner.chains
    finish = None
    budget = stopper.max_new_tokens
    steps = 0
    while finish is None:
        if len(pending) >= sync_every or len(generated) + len(pending) >= budget:
            finish = stopper.accept(generated, torch.cat(pending).tolist())
            pending = []
            if finish is not None:
                break
        if runner.cache.length + 1 > runner.cache.max_len:
            finish = stopper.accept(generated, torch.cat(pending).tolist()) if pending else None
            finish = finish or "length"
            break
        if chain:
            next_token = runner.greedy_step(next_token)  # one graph launch: forward, argmax, feed
        else:
            logits = runner.step(next_token.view(1, 1))
            next_token = sampler.sample(logits[:, -1])
        pending.append(next_token)
        steps += 1
    synchronize(device)
    return finish
