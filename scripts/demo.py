"""`make demo`: summarise real ACL papers with SmolLM2-135M on the embedded defaults.

Writes a JSONL batch of the first few aclsum papers (title, abstract and the start of the
introduction, cut to about 1.5K tokens so the CPU keeps up and SmolLM2's 8K context holds it),
runs `batchd run` (embedded broker, SQLite, one worker, until the batch is done), then prints
each job's SHA-256 and telemetry from the `job_results` view.

    python scripts/demo.py [--papers 4] [--max-new-tokens 80] [--data-dir ./batchd-data]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from batchd.samples import Paper, aclsum_papers

INSTRUCTION = "Summarise the paper above in two sentences: what problem it addresses and what it contributes."
WORDS_PER_PAPER = 1100  # ~1.5K SmolLM2 tokens of academic English


def paper_prompt(paper: Paper, words: int = WORDS_PER_PAPER) -> str:
    """Title, abstract and the introduction onwards, cut at a paragraph near `words` words."""
    kept, count = [f"Title: {paper.title}", f"Abstract: {paper.abstract}"], 0
    count = sum(len(part.split()) for part in kept)
    for paragraph in paper.body.split("\n\n"):
        n = len(paragraph.split())
        if count + n > words:
            break
        kept.append(paragraph)
        count += n
    return "\n\n".join(kept) + f"\n\n{INSTRUCTION}"


def write_batch(path: Path, papers: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for paper in aclsum_papers(limit=papers):
            out.write(json.dumps({"custom_id": paper.paper_id, "prompt": paper_prompt(paper)}) + "\n")


def print_telemetry(database_url: str, batch: str) -> None:
    engine = sa.create_engine(database_url)
    with engine.connect() as connection:
        rows = connection.execute(sa.text(
            "SELECT custom_id, status, output_sha256, prompt_tokens, generated_tokens, queue_wait_s, prefill_s, "
            "prefill_tokens_per_s, decode_s, decode_tokens_per_s, total_s, worker_host, device, error_kind "
            "FROM job_results WHERE batch = :batch ORDER BY job_id"), {"batch": batch}).mappings().all()
    print(f"\n{'paper':<20} {'output_sha256':<64} {'in':>5} {'out':>4} {'wait_s':>7} {'prefill_s':>9} "
          f"{'pf tok/s':>8} {'decode_s':>8} {'tok/s':>6} {'total_s':>7} device")
    for r in rows:
        if r["status"] != "succeeded":
            print(f"{r['custom_id']:<20} {r['status']}: {r['error_kind']}")
            continue
        print(f"{r['custom_id']:<20} {r['output_sha256']} {r['prompt_tokens']:>5} {r['generated_tokens']:>4} "
              f"{r['queue_wait_s']:>7.2f} {r['prefill_s']:>9.2f} {r['prefill_tokens_per_s']:>8.0f} "
              f"{r['decode_s']:>8.2f} {r['decode_tokens_per_s']:>6.1f} {r['total_s']:>7.2f} {r['device']}")
    print(f"\nEvery column is in SQL too: the job_results view of {database_url}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--papers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--batch", default="demo-aclsum")
    parser.add_argument("--data-dir", default=os.environ.get("BATCHD_DATA_DIR", "./batchd-data"))
    parser.add_argument("--write-only", metavar="JSONL", help="Only write the batch file here (e.g. to carry it).")
    args = parser.parse_args()
    if args.write_only:
        write_batch(Path(args.write_only), args.papers)
        print(f"wrote {args.papers} jobs to {args.write_only}")
        return 0
    data_dir = Path(args.data_dir)
    batch_file = data_dir / "demo" / f"{args.batch}.jsonl"
    write_batch(batch_file, args.papers)
    env = dict(os.environ, BATCHD_DATA_DIR=str(data_dir))
    database_url = env.setdefault("BATCHD_DATABASE_URL", f"sqlite:///{data_dir / 'batchd.db'}")
    print(f"submitting {args.papers} aclsum papers from {batch_file} to SmolLM2-135M (CPU)", flush=True)
    run = subprocess.run([sys.executable, "-m", "batchd", "run", str(batch_file), "--batch", args.batch, "--chat",
                          "--max-new-tokens", str(args.max_new_tokens)], env=env)
    if run.returncode != 0:
        return run.returncode
    print_telemetry(database_url, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
