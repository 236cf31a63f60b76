#!/usr/bin/env bash
# Third H200 call: the sharded-KV GPU tests with per-test progress (xdist -v), and the fixed sm90 test.
set -uo pipefail
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
cd "$(dirname "$0")/../.."
timeout -s KILL 20 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernel.py -k forced 2>&1 | tail -2
timeout -s KILL 115 python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE tests/test_shard_attention.py \
  tests/test_sharded_distributed.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tee $OUT/t-shard.log | tail -30
