#!/usr/bin/env bash
# Session 4, call 2: every GPU test group touched this session (xdist), with failures printed.
set -uo pipefail
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
cd "$(dirname "$0")/../.."
run() {  # name, limit, files...
  local name=$1 limit=$2; shift 2
  timeout -s KILL "$limit" python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE "$@" > $OUT/t-$name.log 2>&1
  echo "== $name (rc $?): $(grep -cE ' PASSED' $OUT/t-$name.log) passed, $(grep -cE ' FAILED| ERROR' $OUT/t-$name.log) failed"
  grep -E "^(FAILED|ERROR) |^E  " $OUT/t-$name.log | head -30
  tail -1 $OUT/t-$name.log
}
run shard 230 tests/test_shard_attention.py tests/test_merge_kernels.py tests/test_sharded_distributed.py
run hopper 230 tests/test_host_launch_gpu.py tests/test_triton_hopper_gpu.py tests/test_plans.py tests/test_triton_kernel.py
