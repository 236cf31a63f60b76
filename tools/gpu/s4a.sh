#!/usr/bin/env bash
# Session 4, call 1: the absorbed-MLA split-KV decode path (Gluon) on the H200: GPU tests, then a
# short decode benchmark; plus the sharded-extend GPU test that failed last session, with its error.
set -uo pipefail
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout -s KILL 240 python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE tests/test_shard_attention.py \
  -k "mla" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert|^E " | tee $OUT/t-mla.log | tail -40
timeout -s KILL 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/test_sharded_distributed.py::test_gpu_sharded_extend_single_rank 2>&1 | tail -25
timeout -s KILL 150 python3 -m cpattn.bench decode --shapes mla --cps 1,8 --batches 1,8,64 --keys 32k,128k \
  --q-lens 1,4 --no-crossover --iters 10 --out $OUT/decode-mla 2>&1 | grep -v "^$" | tail -30
