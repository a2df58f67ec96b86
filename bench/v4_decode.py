"""Decode speed of a V4-shaped model (bench/decode.py --v4-layers N): V4-Flash's per-layer sizes and
256 experts, N of its layers, random bf16 weights, batch 1.

The roofline counts the bytes one decode step reads: every weight but the embedding table (a
gathered row) and the routed experts, plus each layer's k active experts (k distinct experts a
token at batch 1: hash rows are drawn distinct, top-k is). The cache (window rows and compressed
entries, a few MB at these contexts) is left out.
"""
from __future__ import annotations

import time

import torch

from bench.v4_shapes import expert_bytes, random_v4_model, v4_config


def decode_bytes_per_token(model) -> int:
    config = model.config
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if name != "embed_tokens.weight" and ".experts." not in name)
    active = config.num_layers * config.experts_per_token * expert_bytes(config, model.dtype.itemsize)
    return dense + active


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def time_decode(model, prompt_len: int, new_tokens: int, warmup: int = 3) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy sequence; the first `warmup` decode steps (kernel
    compiles) are not timed."""
    device = model.device
    cache = model.new_cache(prompt_len + warmup + new_tokens + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    synchronize(device)
    start = time.perf_counter()
    token = model(prompt.to(device), cache, last_only=True)[0, -1].argmax().view(1, 1)
    synchronize(device)
    prefill_s = time.perf_counter() - start
    for _ in range(warmup):
        token = model(token, cache)[0, -1].argmax().view(1, 1)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = model(token, cache)[0, -1].argmax().view(1, 1)
    synchronize(device)
    return prompt_len / prefill_s, new_tokens / (time.perf_counter() - start)


def bench_v4(layers: int, prompt_len: int, new_tokens: int, bandwidth: float | None, smoke: bool) -> dict:
    """One row: tok/s against the roofline of the bytes a decode step reads (no roofline in a smoke run)."""
    config = v4_config(layers, tiny=smoke)
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    model = random_v4_model(config, device, dtype)
    prefill_tok_s, tok_s = time_decode(model, prompt_len, new_tokens)
    step_bytes = decode_bytes_per_token(model)
    row = {"shape": f"v4-flash x{layers} layers" if not smoke else f"v4-tiny x{layers} layers",
           "context": prompt_len, "new": new_tokens, "decode tok/s": tok_s, "GB a step": step_bytes / 1e9,
           "prefill tok/s": prefill_tok_s}
    if bandwidth:
        roofline = bandwidth / step_bytes
        row.update({"roofline tok/s": roofline, "of roofline": tok_s / roofline})
    return row
