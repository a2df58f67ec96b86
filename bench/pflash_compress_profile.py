"""Where a PFlash job's compression time goes on the GPU: per-phase seconds (synchronised) for
jobs of about --prompt tokens with a resident --drafter-shape drafter, and a cProfile of the
whole loop (autotuning, host syncs, Python overhead show up there).

    python bench/pflash_compress_profile.py --tokenizer-dir .carry/tok
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.random_checkpoint import write_checkpoint  # noqa: E402
from bench.service_throughput import documents, load_codec  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.types import CompressionOptions, GenerationRequest, SamplingParams, Telemetry  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--target-shape", default="qwen2.5-1.5b")
    parser.add_argument("--drafter-shape", default="qwen2.5-0.5b")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--keep", type=float, default=0.2)
    args = parser.parse_args()
    tokenizer_dir = Path(args.tokenizer_dir)
    codec = load_codec(tokenizer_dir)
    model = build_model(preset(args.target_shape), "cuda", torch.bfloat16, seed=0)
    engine = Engine(model, codec, EngineConfig(device="cuda", max_context=args.prompt + 512), eos_ids=set())
    engine.compressor.residency.keep_resident = 1
    drafter = Path(tempfile.mkdtemp()) / "drafter"
    write_checkpoint(args.drafter_shape, tokenizer_dir, drafter, "cuda", seed=1)
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=8), compression=CompressionOptions(
        mode="always", keep_ratio=args.keep, drafter_path=str(drafter)))
    texts = documents(codec, args.jobs + 2, args.prompt, seed=3)
    for text in texts[:2]:   # load the drafter, first shapes
        engine.compress(codec.encode(text), request, Telemetry())
    torch.cuda.synchronize()
    per_job = []
    profile = cProfile.Profile()
    profile.enable()
    for text in texts[2:]:
        started = time.perf_counter()
        ids = codec.encode_request(text, None, False)
        encoded = time.perf_counter()
        telemetry = Telemetry()
        engine.compress(ids, request, telemetry)
        torch.cuda.synchronize()
        per_job.append((encoded - started, telemetry.scoring_s, time.perf_counter() - encoded, len(ids)))
    profile.disable()
    n = len(per_job)
    print(f"{n} jobs of ~{args.prompt} tokens, {args.drafter_shape}-shape drafter resident:")
    print(f"  encode {sum(p[0] for p in per_job) / n * 1e3:.1f} ms, scoring {sum(p[1] for p in per_job) / n * 1e3:.1f} ms, "
          f"compress total {sum(p[2] for p in per_job) / n * 1e3:.1f} ms a job; lengths {sorted({p[3] for p in per_job})[:8]}")
    print("  per job (ms):", [round(p[2] * 1e3, 1) for p in per_job])
    pstats.Stats(profile).sort_stats("cumulative").print_stats(16)
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for text in texts[2:6]:
            engine.compress(codec.encode(text), request, Telemetry())
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
