"""The token-id generation loop without speculation: prefill, then one token per step.

Phases: (1) prefill the prompt in chunks, (2) sample the first token, (3) decode step by step.
On CUDA the loop never waits for the GPU between tokens: each sampled id stays on the device and
feeds the next (graph-replayed) step; the host reads the ids back every `sync_every` steps, a few
steps late, to check EOS, stop strings and the budget. Steps run past the end are simply discarded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from batchd.engine.sampling import Sampler
from batchd.engine.step import StepRunner
from batchd.engine.stopping import StopChecker


@dataclass
class TokenOutput:
    token_ids: list[int]
    finish_reason: str
    prefill_s: float       # the prompt's forward and the first token's sampling (time to first token)
    decode_s: float        # everything after: the steps that produce the other tokens

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens the decode phase produced per second of it: the first generated token comes from
        the prefill's logits, so the decode steps made the other len - 1 (as time per output token
        is usually counted, and as bench/decode.py counts transformers' generate); 0.0 when they
        made none (a one-token answer)."""
        made = len(self.token_ids) - 1
        return made / self.decode_s if made > 0 and self.decode_s > 0 else 0.0


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
                   *, prefill_chunk: int = 2048, sync_every: int | None = None,
                   read_lag: int | None = None) -> TokenOutput:
    """Prefill, sample the first token, decode (`decode_plain`, whose defaults the None options take)."""
    device = runner.cache.device
    started = time.perf_counter()
    logits = prefill_prompt(runner, prompt_ids, prefill_chunk)
    next_token = sampler.sample(logits[:, -1])  # [1]
    synchronize(device)
    prefill_s = time.perf_counter() - started

    started = time.perf_counter()
    generated: list[int] = []
    finish = decode_plain(runner, next_token, sampler, stopper, generated, sync_every=sync_every, read_lag=read_lag)
    return TokenOutput(generated, finish, prefill_s, time.perf_counter() - started)


def decode_plain(runner: StepRunner, next_token: torch.Tensor, sampler: Sampler, stopper: StopChecker,
                 generated: list[int], *, sync_every: int | None = None, read_lag: int | None = None) -> str:
    """Decode one token per step from `next_token` ([1] on the device: sampled, not yet fed) until
    a stop rule applies; appends to `generated` and returns the finish reason. Also the fallback of
    speculative decoding once it switches itself off (engine.speculative).

    On CUDA each batch of `sync_every` ids is copied to the host without waiting and read only once
    `read_lag` more steps are queued behind it, so the GPU does not idle while the host checks stop
    rules. On a quiet host this measures the same as reading at once (`bench/readback.py`); the lag
    is slack for a worker whose host is busy. After a stop, the steps already queued (fewer than
    sync_every + read_lag) are discarded."""
    device = runner.cache.device
    on_cuda = device.type == "cuda"  # elsewhere the host computed the ids: read each one at once
    sync_every = sync_every if sync_every is not None else (16 if on_cuda else 1)
    read_lag = read_lag if read_lag is not None else (2 if on_cuda else 0)
    pending = [next_token]  # device ids not yet sent to the host
    in_flight: _HostIds | None = None  # the last batch sent, not yet read
    chain = sampler.greedy and runner.chains
    budget = stopper.max_new_tokens
    while True:
        queued = len(generated) + len(pending) + (len(in_flight) if in_flight is not None else 0)
        last = queued >= budget or runner.cache.length + 1 > runner.cache.max_len
        send = len(pending) >= sync_every or last
        # the batch in flight is read once read_lag steps are queued behind it, and always before
        # the next batch is sent (ids are accepted in order)
        if in_flight is not None and (len(pending) >= read_lag or send):
            finish = stopper.accept(generated, in_flight.read())
            in_flight = None
            if finish is not None:
                break
        if send:
            batch, pending = _HostIds(pending), []
            if last:  # the budget is spent or the cache is full
                finish = stopper.accept(generated, batch.read()) or "length"
                break
            in_flight = batch
        if chain:
            next_token = runner.greedy_step(next_token)  # one graph launch: forward, argmax, feed
        else:
            logits = runner.step(next_token.view(1, 1))
            next_token = sampler.sample(logits[:, -1])
        pending.append(next_token)
    synchronize(device)
    return finish


class _HostIds:
    """Device ids [1] each -> one host copy, started at once (pinned, non-blocking on CUDA) and
    waited for in `read`."""

    def __init__(self, ids: list[torch.Tensor]):
        self.count = len(ids)
        self.host, self.ready = None, None
        if not ids:
            return
        on_device = torch.cat(ids)
        if on_device.is_cuda:
            self.host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
            self.host.copy_(on_device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = on_device

    def __len__(self) -> int:
        return self.count

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return [] if self.host is None else self.host.tolist()
