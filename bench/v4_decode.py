"""Decode speed of a V4-shaped model (bench/decode.py --v4-layers N): V4-Flash's per-layer sizes and
256 experts, N of its layers (`--v4-layers fit`: as many as the GPU holds), random bf16 weights,
batch 1.

The roofline counts the bytes one decode step reads: every weight but the embedding table (a
gathered row) and the routed experts, plus each layer's k active experts (k distinct experts a
token at batch 1: hash rows are drawn distinct, top-k is). The cache (window rows and compressed
entries, a few MB at these contexts) is left out.
"""
from __future__ import annotations

import time

import torch

from bench.v4_shapes import expert_bytes, layers_that_fit, random_v4_model, v4_config
from batchd.engine.generate import synchronize


def decode_bytes_per_token(model) -> int:
    config = model.config
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if name != "embed_tokens.weight" and ".experts." not in name)
    active = config.num_layers * config.experts_per_token * expert_bytes(config, model.dtype.itemsize)
    return dense + active


@torch.inference_mode()
def time_decode(model, prompt_len: int, new_tokens: int, warmup: int = 3) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy sequence; a short prompt on a cache of its own
    and the first `warmup` decode steps (kernel compiles) are not timed."""
    device = model.device
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    model(prompt[:, : min(prompt_len, 64)].to(device), model.new_cache(prompt_len + 1), last_only=True)
    cache = model.new_cache(prompt_len + warmup + new_tokens + 1)
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


# GPU memory left beside the weights with `--v4-layers fit`: the cache (16 documents of 4,352
# positions keep about 0.4 GB a layer), the MoE's grouped-GEMM workspace and a 512-token chunk's activations
FIT_RESERVE_BYTES = 12e9


def resolve_layers(layers: int | str, smoke: bool) -> int:
    """--v4-layers: a number, or "fit" (as many V4-Flash layers as the GPU holds in bf16)."""
    if layers != "fit":
        return layers
    if smoke:
        raise ValueError("--v4-layers fit sizes a V4-Flash model to the GPU; give a number with --v4-smoke")
    return layers_that_fit("cuda", torch.bfloat16, FIT_RESERVE_BYTES)


def bench_v4(layers: int | str, prompt_len: int, new_tokens: int, bandwidth: float | None, smoke: bool) -> dict:
    """One row: tok/s against the roofline of the bytes a decode step reads (no roofline in a smoke run)."""
    layers = resolve_layers(layers, smoke)
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


@torch.inference_mode()
def bench_v4_batch(layers: int | str, docs: int, prompt_len: int, new_tokens: int, smoke: bool, chunk: int = 512,
                   phases: bool = False) -> dict:
    """Documents per hour of the overnight workload on a V4-shaped model (bench/throughput.py
    --v4-layers N): `docs` random prompts of `prompt_len` tokens -> `new_tokens` greedy tokens each
    (EOS ignored) through the V4 batch engine, every document in flight at once; after a warm-up
    of two short documents. `phases`: each step synchronised, and the seconds of steps that ran
    prompt chunks apart from those that only decoded."""
    from batchd.engine.deepseek_v4.batch import V4BatchEngine
    from batchd.engine.types import GenerationRequest, SamplingParams

    layers = resolve_layers(layers, smoke)
    config = v4_config(layers, tiny=smoke)
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    model = random_v4_model(config, device, dtype)
    batch = V4BatchEngine(model, max_context=prompt_len + new_tokens + 64, eos_ids=set(), block_size=64 if not smoke else 16,
                          chunk=chunk if not smoke else 128, max_running=docs)
    generator = torch.Generator().manual_seed(0)

    def run(n: int, length: int, new: int) -> tuple[float, int, dict]:
        """-> (seconds, tokens generated, {"prefill" / "decode": [steps, synchronised seconds]})."""
        seqs = [batch.submit(torch.randint(0, config.vocab_size, (length,), generator=generator).tolist(),
                             GenerationRequest(sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)))
                for _ in range(n)]
        kinds = {"prefill": [0, 0.0], "decode": [0, 0.0]}
        synchronize(model.device)
        start = time.perf_counter()
        while batch.has_work:
            began = time.perf_counter()
            batch.step()
            if phases:
                synchronize(model.device)
                kind = kinds["prefill" if batch.last_plan.chunks or batch.last_plan.replay else "decode"]
                kind[0] += 1
                kind[1] += time.perf_counter() - began
        synchronize(model.device)
        return time.perf_counter() - start, sum(len(s.generated) for s in seqs), kinds

    run(2, min(prompt_len, 256), 4)
    seconds, tokens, kinds = run(docs, prompt_len, new_tokens)
    row = {"system": f"V4 batch engine, {'v4-tiny' if smoke else 'v4-flash'} x{layers} layers", "docs": docs,
           "seconds": seconds, "docs/hour": docs / seconds * 3600, "out tok/s": tokens / seconds}
    if phases:
        (chunk_steps, chunk_s), (decode_steps, decode_s) = kinds["prefill"], kinds["decode"]
        row.update({"chunk steps": chunk_steps, "chunk steps s": chunk_s,
                    "decode steps": decode_steps, "decode steps s": decode_s})
    return row
