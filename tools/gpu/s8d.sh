#!/usr/bin/env bash
# Session 7, fourth call: GPU tests of the plan-time split-KV workspace and the shard plan's
# one-compare per-layer checks, then the decode table again (C = 1 / 8, B = 1 / 8, L = 128k / 1M)
# for the host-side change (eager columns).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s7d.log; : > "$T"
. tools/gpu/_tests.sh
run_tests shard 270 tests/test_shard_attention.py tests/test_merge_kernels.py tests/test_sharded_distributed.py \
  tests/test_host_launch_gpu.py
timeout -s KILL 200 python3 -m cpattn.bench decode --shapes mla,gqa --cps 1,8 --batches 1,8 --keys 128k,1m \
  --q-lens 1,4 --iters 20 --no-crossover --out $OUT/decode-h200-s7d > $OUT/decode-h200-s7d.log 2>&1
echo "decode rc $?"; grep -E "C=8 / C=1.*B=1 |GQA" $OUT/decode-h200-s7d.log | cut -c1-160
