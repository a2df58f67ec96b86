"""Try decode-step variants on whole steps: each variant gets a fresh engine (its graphs captured
under it), and its decode tok/s and greedy ids are compared with the first variant's. Trigger points,
preloads and early reads (early_reads) change no value, so their ids must be equal; another tile, block or split changes
the order of a sum and may move the ids of random weights (a "False" there is not a bug).

A variant is space-separated settings, "table" for none:
  OPTION=VALUE                    a kernels.options.KernelOptions field for this variant's engine
                                  (pdl_trigger=2 or linear:2,split:0: where the decode kernels signal
                                  their dependents, kernels._pdl; early_reads=0|force; pdl=0;
                                  fused_mlp=0|1; stream_carveout=PERCENT; stream_producer_trigger=1;
                                  stream_phase_marks=1|2; the old BATCHD_PDL_TRIGGER=... spelling works)
  N,K=bn,bk,splits,stages[,preload][,field:value...]   replaces small_linear's table entry for that
                                  weight shape (field: any SmallLinearConfig field, num_warps:8)
  N,K=gemv,rows[,warps]           the same with a gemv config (rows weight rows per program)
  N,K=stream[,ring_kb[,ctas]][,field:value...]   the same with kernels.stream_linear (bulk-copy
                                  weight ring of ring_kb KB, ctas CTAs per SM; fields such as
                                  stream_min_kb:114, stream_max_ctas:128)
  preload=D[@MB]                  every table entry preloads D weight tiles (only weights of at
                                  least MB megabytes; the others 0)
  reduce=BLOCK                    columns per program of small_linear's split-K reduce (REDUCE_BLOCK)
  attnG=bn,warps,stages,fit       replaces decode attention's tile for query-head group size G
                                  (kernels.decode_attention.triton_kernel.DecodeTile; warps 0: auto)
  attn_splits=N                   at most N key splits per decode attention call instead of 132
                                  (kernels.decode_attention.triton_kernel.MAX_SPLITS)
  merge_cols=N                    N output columns a merge program (triton_kernel.MERGE_COLUMNS; 0: all)
  mlp=I,H,programs,bk,bn,warps,stages[,field:value]   kernels.fused_mlp's config for that MLP shape
                                  (programs 0: one per multiprocessor; it sets fused_mlp=1)
  mlp=I,H,stream[,ring_kb][,field:value]  the same on the bulk-copy stream kernel (kernels/fused_mlp/stream_mlp.cu)
  attention_cluster=0|8|16        decode attention on the cluster kernel with 8 or 16 CTAs a KV head
                                  (kernels/decode_attention/cluster_kernel.py), or 0: Triton's split and merge
  attention_key_block=32|64       that kernel's keys a step of its online softmax
  skip=merge|reduce|o             a what-if, not a config: the step runs without that launch (the
                                  attention merge; small_linear's split-K reduce; the o projection,
                                  its output the residual unchanged), its consumer reading
                                  whatever the buffer holds. The ids are garbage; the tok/s bounds what
                                  folding that launch into its neighbour could gain at best
  N,K=...,skip_wait:1             another what-if: that weight's kernel never waits for the kernel
                                  before (SmallLinearConfig.skip_wait; ids garbage). A loose bound on
                                  a finer handoff than griddepcontrol.wait: the kernel then overlaps
                                  all of the one before, which no real handoff can

    python bench/step_sweep.py --shapes qwen2.5-1.5b --variants "table;pdl_trigger=2;2048,1536=16,512,1,4,3"
    python bench/step_sweep.py --shapes qwen2.5-1.5b --variants "table;early_reads=0;table"
    python bench/step_sweep.py --shapes qwen2.5-1.5b --prompt 32768 --variants "table;pdl_trigger=linear:2"
    python bench/step_sweep.py --shapes qwen2.5-1.5b,llama-3-8b --variants "table;preload=0;preload=4@100"
    python bench/step_sweep.py --shapes qwen2.5-1.5b --variants "table;1536,8960=64,128,10,3,2" --rounds 3
    python bench/step_sweep.py --shapes qwen2.5-1.5b --variants "table;skip=merge;skip=reduce;skip=merge skip=reduce" --rounds 3

Differences of 1-2% need --rounds 3 or more: the first run of a process reads fast (run_order),
which is why one warm-up run of the first variant precedes the timed ones by default.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, linear_config, print_table  # noqa: E402
from bench.decode import kv_bytes_per_token, time_ours, weight_bytes_per_token  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.kernels.decode_attention import triton_kernel as attention_kernel  # noqa: E402
from batchd.kernels.fused_mlp import triton_kernel as mlp_kernel  # noqa: E402
from batchd.kernels.options import KernelOptions, environment_defaults, parse_option, set_kernel_options  # noqa: E402
from batchd.kernels.small_matmul import NormInputs, triton_kernel  # noqa: E402

TILES = dict(attention_kernel.TUNED_TILES)
REDUCE_BLOCK = triton_kernel.REDUCE_BLOCK


OPTIONS = tuple(field.name for field in dataclasses.fields(KernelOptions))
MLP_TUNED = dict(mlp_kernel.TUNED)
MERGE_SPLITS = attention_kernel.merge_splits
MAX_SPLITS = attention_kernel.MAX_SPLITS
MERGE_COLUMNS = attention_kernel.MERGE_COLUMNS
REDUCE_KERNEL = triton_kernel._reduce_splits_kernel
SMALL_LINEAR = triton_kernel.small_linear_triton


class _SkippedLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing (skip=reduce)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _skip_o(x, weight, bias=None, *, residual=None, emit_norm_weight=None, row_sumsq=None, gated=False, **kwargs):
    """small_linear_triton without the o projection's launch (skip=o): an o call (residual added, the
    post-attention norm's inputs emitted, a square weight) returns the residual and empty norm inputs."""
    is_o = (residual is not None and emit_norm_weight is not None and row_sumsq is None and not gated
            and weight.shape[0] == weight.shape[1] == x.shape[1])
    if not is_o:
        return SMALL_LINEAR(x, weight, bias, residual=residual, emit_norm_weight=emit_norm_weight,
                            row_sumsq=row_sumsq, gated=gated, **kwargs)
    sumsq = torch.empty(1, x.shape[0], dtype=torch.float32, device=x.device)
    return residual, NormInputs(torch.empty_like(residual), sumsq)


def skip_launch(name: str) -> None:
    if name == "o":
        triton_kernel.small_linear_triton = _skip_o
    elif name == "merge":
        attention_kernel.merge_splits = lambda o_part, l_part, out, *args, **kwargs: out
    elif name == "reduce":
        triton_kernel._reduce_splits_kernel = _SkippedLaunch()
    else:
        raise SystemExit(f"skip={name}: merge, reduce or o")


def apply_variant(spec: str, tuned: dict) -> None:
    """Set the kernel options and table entries of `spec`, everything else back to its default."""
    options = {}
    set_kernel_options(None)
    triton_kernel.TUNED.clear()
    triton_kernel.TUNED.update(tuned)
    mlp_kernel.TUNED.clear()
    mlp_kernel.TUNED.update(MLP_TUNED)
    attention_kernel.TUNED_TILES.clear()
    attention_kernel.TUNED_TILES.update(TILES)
    triton_kernel.REDUCE_BLOCK = REDUCE_BLOCK
    attention_kernel.merge_splits = MERGE_SPLITS
    attention_kernel.MAX_SPLITS = MAX_SPLITS
    attention_kernel.MERGE_COLUMNS = MERGE_COLUMNS
    triton_kernel._reduce_splits_kernel = REDUCE_KERNEL
    triton_kernel.small_linear_triton = SMALL_LINEAR
    for item in spec.split():
        if item == "table":
            continue
        shape, _, values = item.partition("=")
        if shape.removeprefix("BATCHD_").lower() in OPTIONS:
            options.update([parse_option(shape, values)])
            continue
        if shape.startswith("BATCHD_"):
            raise SystemExit(f"unknown option {shape}: one of {OPTIONS}")
        if shape == "preload":
            depth, _, min_mb = values.partition("@")
            triton_kernel.TUNED.update({
                (n, k, size): dataclasses.replace(cfg, preload=int(depth) if n * k * size >= float(min_mb or 0) * 1e6 else 0)
                for (n, k, size), cfg in tuned.items()})
            continue
        if shape == "mlp":
            intermediate, hidden, config = mlp_config(values)
            mlp_kernel.TUNED[(intermediate, hidden, 2)] = config
            options["fused_mlp"] = True
            continue
        if shape == "attn_splits":
            attention_kernel.MAX_SPLITS = int(values)
            continue
        if shape == "merge_cols":
            attention_kernel.MERGE_COLUMNS = int(values)
            continue
        if shape == "skip":
            skip_launch(values)
            continue
        if shape == "reduce":
            triton_kernel.REDUCE_BLOCK = int(values)
            continue
        if shape.startswith("attn"):
            bn, warps, stages, fit = (int(v) for v in values.split(","))
            attention_kernel.TUNED_TILES[int(shape[4:])] = attention_kernel.DecodeTile(bn, warps or None, stages, bool(fit))
            continue
        n, k = (int(v) for v in shape.split(","))
        triton_kernel.TUNED[(n, k, 2)] = linear_config(values)
    set_kernel_options(dataclasses.replace(environment_defaults(), **options) if options else None)


def mlp_config(values: str):
    """`I,H,programs,block_k,block_n,warps,stages[,field:value...]` -> (I, H, FusedMlpConfig); programs
    0: one per multiprocessor (`remainder:0` holds a slice in one padded power-of-2 tile).
    `I,H,stream[,ring_kb][,field:value...]`: the slices on kernels/fused_mlp/stream_mlp.cu."""
    items = values.split(",")
    named = {name: int(value) for name, value in (item.split(":") for item in items if ":" in item)}
    if len(items) >= 3 and items[2] == "stream":
        plain = [v for v in items[3:] if ":" not in v]
        ring = {"ring_kb": int(plain[0])} if plain else {}
        return int(items[0]), int(items[1]), mlp_kernel.FusedMlpConfig(stream=True, **ring, **named)
    intermediate, hidden, programs, block_k, block_n, warps, stages = (int(v) for v in items if ":" not in v)
    return intermediate, hidden, mlp_kernel.FusedMlpConfig(programs, block_k, block_n, warps, stages, **named)


def run_order(variants: list[str], rounds: int, warmup: int) -> list[tuple[str, bool]]:
    """(variant, timed) in run order: `warmup` untimed runs of the first variant, then the whole
    list `rounds` times over, interleaved (A B C A B C ...). The first run in a process reads about
    1.5% fast whatever its variant (the table's first run 835-842 tok/s, its later runs
    820-829 in the same call), so a variant compared with that run looks slower than it is."""
    return [(variants[0], False)] * warmup + [(v, True) for _ in range(rounds) for v in variants]


def medians(rows: list[dict]) -> list[dict]:
    """One row per (shape, variant): the median decode tok/s over its timed runs, in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["shape"], row["variant"]), []).append(row)
    out = []
    for (shape, variant), runs in groups.items():
        speeds = sorted(r["decode tok/s"] for r in runs)
        out.append({"shape": shape, "variant": variant, "runs": len(runs), "median tok/s": speeds[len(speeds) // 2],
                    "min": speeds[0], "max": speeds[-1]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b")
    parser.add_argument("--variants", default="table", help="variants separated by ';'")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="run the variant list this many times, interleaved")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of the first variant first (run_order)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    tuned = dict(triton_kernel.TUNED)
    rows = []
    for name in args.shapes.split(","):
        config = preset(name)
        model = build_model(config, "cuda", torch.bfloat16)
        prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        roofline = bandwidth / (weight_bytes_per_token(model) + kv_bytes_per_token(config, args.prompt + args.new_tokens / 2))
        base_ids = None
        for spec, timed in run_order(args.variants.split(";"), args.rounds, args.warmup):
            apply_variant(spec, tuned)
            engine = Engine(model, None, EngineConfig(max_context=args.prompt + args.new_tokens + 16), eos_ids=set())
            out, tok_s = time_ours(engine, prompt, args.new_tokens)
            del engine
            gc.collect()
            if not timed:
                print(f"warm-up run of {spec!r}: {tok_s:.0f} tok/s, not reported", flush=True)
                continue
            base_ids = base_ids or out.token_ids
            rows.append({"shape": name, "context": args.prompt, "variant": spec, "decode tok/s": tok_s,
                         "of roofline": tok_s / roofline, "same ids": out.token_ids == base_ids})
            print(rows[-1], flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    apply_variant("table", tuned)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print_table(rows)
    if args.rounds > 1:
        print_table(medians(rows))


if __name__ == "__main__":
    main()
