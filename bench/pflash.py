"""PFlash on one GPU: drafter scoring time, target park/unpark, time to first token.

Random weights at real shapes (speed does not depend on weight values): a Qwen2.5-0.5B-shaped
drafter and a Llama-3-8B-shaped target, bf16. The drafter is written once as a Hugging Face
folder in a temporary directory, so each compressing job loads it from disk as a worker does.
The two use different vocabularies (151,936 and 128,256), so the cross-tokenizer text bridge
runs too: synthetic word-level tokenizers ("w0 w1 ..."), faster than real BPE ones.

Prints one table of rows (what, tokens, seconds, notes):
  score       drafter prefill + tail scoring at each length (the default one-chunk prefill,
              and --score-chunk chunks for comparison)
  park/unpark the target, strategy "host" (pinned host copy; the first park also pins) and
              "reload" (dropped, read again from a safetensors folder on disk unless
              --reload-random, which re-draws the random weights instead)
  ttft        at --ttft-tokens: uncompressed prefill + first token, against compressed
              (drafter load + score + select + bridge [+ park + unpark] + compressed prefill +
              first token), in the same run; once with parking as the worker decides (both fit
              on an H200: no parking) and once with parking forced (host)

Run on the H200:   python bench/pflash.py
Smaller / on CPU:  python bench/pflash.py --device cpu --dtype fp32 --target smollm2-135m \\
                       --drafter-layers 4 --lengths 1024,4096 --ttft-tokens 4096
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from engine.model import unfuse_hf_tensors  # noqa: E402
from engine.presets import hf_config_dict, preset  # noqa: E402
from engine.pflash import PromptCompressor, compress_for_request, set_compressor  # noqa: E402
from engine.pflash.scoring import score_prompt  # noqa: E402
from engine.residency import Residency  # noqa: E402
from engine.runtime import Engine, build_model, parse_dtype  # noqa: E402
from engine.text import TextCodec  # noqa: E402
from engine.types import CompressionOptions, GenerationRequest, SamplingParams, Telemetry  # noqa: E402


def word_tokenizer(vocab_size: int, offset: int = 0):
    """Words w0..w{n} -> ids offset.. (ids below `offset` are filler words): two of these with
    different offsets are different tokenizers over the same text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    words = vocab_size - offset
    vocab = {f"f{i}": i for i in range(offset)} | {f"w{i}": offset + i for i in range(words)}
    vocab["[UNK]"] = vocab.pop(f"f{offset - 1}") if offset else vocab.pop(f"w{words - 1}")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def save_hf_folder(folder: Path, model, config, tokenizer) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model, config)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config_dict(config)))
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def hf_tensors(model, config) -> dict[str, torch.Tensor]:
    """Our fused parameters back to Hugging Face names, on the CPU."""
    state = {name: p.detach().to("cpu") for name, p in model.named_parameters()}
    return {name: t.contiguous() for name, t in unfuse_hf_tensors(state, config).items()}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def attempt(rows: list[dict], what: str, tokens, fn, device):
    """Run fn; an error (OOM included) becomes a row instead of ending the benchmark."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not stop
        rows.append({"what": what, "tokens": tokens, "seconds": None, "notes": f"{type(exc).__name__}: {exc}"[:120]})
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return None


def bench_scoring(rows, drafter_model, lengths, chunks, device):
    for n in lengths:
        ids = torch.randint(0, drafter_model.config.vocab_size, (n,)).tolist()
        for chunk in sorted({min(c, n) for c in chunks}, reverse=True):
            label = "one chunk" if chunk >= n else f"chunks of {chunk}"

            def run():
                score_prompt(drafter_model, ids[:256], prefill_chunk=chunk)  # warm-up
                if torch.device(device).type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                _, seconds = timed(lambda: score_prompt(drafter_model, ids, prefill_chunk=chunk), device)
                peak = torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else 0
                rows.append({"what": "score", "tokens": n, "seconds": seconds,
                             "notes": f"{label}; peak {peak:.1f} GiB" if peak else label})

            attempt(rows, "score", n, run, device)


def bench_parking(rows, engine, device, reload_folder):
    for strategy in ("host", "reload"):
        if strategy == "reload":
            engine.checkpoint_path = str(reload_folder) if reload_folder else ""
        residency = Residency(strategy=strategy)
        for attempt_no in (1, 2):
            def run():
                _, park_s = timed(lambda: residency.park(engine), device)
                _, unpark_s = timed(lambda: residency.unpark(engine), device)
                first = "first: pins host memory" if strategy == "host" and attempt_no == 1 else ""
                source = "" if strategy == "host" else ("from disk" if reload_folder else "random re-draw")
                rows.append({"what": f"park {strategy}", "tokens": None, "seconds": park_s, "notes": first})
                rows.append({"what": f"unpark {strategy}", "tokens": None, "seconds": unpark_s,
                             "notes": first or source})

            attempt(rows, f"park/unpark {strategy}", None, run, device)
        residency.release_host_copy()
    engine.checkpoint_path = ""


def first_token_seconds(engine, ids) -> float:
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=1, ignore_eos=True))
    return engine.generate_ids(ids, request).prefill_s


def bench_ttft(rows, engine, drafter_folder, tokens, keep_ratio, device):
    words = " ".join(f"w{i}" for i in torch.randint(0, 120_000, (tokens,)).tolist())
    ids = engine.codec.encode(words, add_special_tokens=False)
    first_token_seconds(engine, ids[:512])  # warm-up

    def uncompressed():
        seconds = first_token_seconds(engine, ids)
        rows.append({"what": "ttft uncompressed", "tokens": len(ids), "seconds": seconds,
                     "notes": "prefill of the full prompt + first token"})
        return seconds

    full = attempt(rows, "ttft uncompressed", len(ids), uncompressed, device)
    options = CompressionOptions(mode="always", keep_ratio=keep_ratio, drafter_path=str(drafter_folder))
    for park in ("auto", "always"):
        def compressed():
            set_compressor(engine, PromptCompressor(Residency(park=park, strategy="host")))
            telemetry = Telemetry()
            kept, compress_s = timed(lambda: compress_for_request(
                engine, ids, GenerationRequest(prompt="-", compression=options), telemetry), device)
            prefill_s = first_token_seconds(engine, kept)
            total = compress_s + prefill_s
            t = telemetry
            rest = compress_s - t.park_s - t.drafter_load_s - t.scoring_s - t.unpark_s
            notes = (f"park {t.park_s:.2f} + load {t.drafter_load_s:.2f} + score {t.scoring_s:.2f} + unpark "
                     f"{t.unpark_s:.2f} + bridge/select {rest:.2f} + prefill {prefill_s:.2f} ({len(kept)} tokens)")
            if full:
                notes += f"; {total / full:.2f} x uncompressed"
            rows.append({"what": f"ttft compressed, park {park}", "tokens": len(ids), "seconds": total, "notes": notes})

        attempt(rows, f"ttft compressed, park {park}", len(ids), compressed, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--target", default="llama-3-8b")
    parser.add_argument("--drafter", default="qwen2.5-0.5b")
    parser.add_argument("--drafter-layers", type=int, default=None, help="fewer drafter layers (CPU runs)")
    parser.add_argument("--lengths", default="8192,32768,131072")
    parser.add_argument("--score-chunk", type=int, default=8192, help="also score in chunks of this size")
    parser.add_argument("--ttft-tokens", type=int, default=131072)
    parser.add_argument("--keep-ratio", type=float, default=0.1)
    parser.add_argument("--reload-random", action="store_true", help="reload strategy re-draws random weights "
                        "instead of reading a checkpoint written to disk (saves writing the target)")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: score,park,ttft")
    args = parser.parse_args()
    device, skip = args.device, set(filter(None, args.skip.split(",")))
    lengths = [int(x) for x in args.lengths.split(",")]
    dtype = parse_dtype(args.dtype, device)
    tmp = Path(tempfile.mkdtemp(prefix="batchd-pflash-bench-"))
    rows: list[dict] = []

    drafter_cfg = preset(args.drafter, **({"num_layers": args.drafter_layers} if args.drafter_layers else {}))
    target_cfg = preset(args.target)
    drafter_tok = word_tokenizer(drafter_cfg.vocab_size, offset=1000)
    target_tok = word_tokenizer(target_cfg.vocab_size)

    drafter_model = build_model(drafter_cfg, device, dtype, seed=1)
    drafter_folder = save_hf_folder(tmp / "drafter", drafter_model, drafter_cfg, drafter_tok)
    if "score" not in skip:
        bench_scoring(rows, drafter_model, lengths, sorted({max(lengths), args.score_chunk}), device)
    del drafter_model
    gc.collect()

    context = max(args.ttft_tokens, 1024) + 64
    engine = Engine.from_config(target_cfg, device=device, dtype=args.dtype, max_context=context,
                                codec=TextCodec(target_tok))
    weights_gib = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30
    rows.append({"what": "target", "tokens": context, "seconds": None,
                 "notes": f"{args.target}: weights {weights_gib:.1f} GiB, KV cache {engine.cache.nbytes / 2**30:.1f} GiB"})
    if "park" not in skip:
        reload_folder = None
        if not args.reload_random:
            reload_folder = save_hf_folder(tmp / "target", engine.model, target_cfg, target_tok)
        bench_parking(rows, engine, device, reload_folder)
    if "ttft" not in skip:
        bench_ttft(rows, engine, drafter_folder, args.ttft_tokens, args.keep_ratio, device)
    print_table(rows)


if __name__ == "__main__":
    main()
