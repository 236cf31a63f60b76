#!/usr/bin/env bash
# Session 4, last call: the GPU tests the earlier calls did not reach (slow oracles), the fixed
# direct-launch test and the sharded-extend test.
set -uo pipefail
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
cd "$(dirname "$0")/../.."
timeout -s KILL 230 python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE \
  "tests/test_shard_attention.py::test_gpu_mla_kernel_shard_attention" \
  "tests/test_shard_attention.py::test_gpu_split_kv_at_128k_keys" tests/test_merge_kernels.py \
  tests/test_sharded_distributed.py "tests/test_host_launch_gpu.py::test_gpu_direct_launch_is_bit_identical_to_the_jit" \
  > $OUT/t-last.log 2>&1
echo "rc $?: $(grep -cE ' PASSED' $OUT/t-last.log) passed, $(grep -cE ' FAILED| ERROR' $OUT/t-last.log) failed"
grep -E " PASSED| FAILED|^E  " $OUT/t-last.log | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | head -60
