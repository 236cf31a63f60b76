#!/usr/bin/env bash
# Second H200 call: the GPU tests of every issue, one file group at a time (each with its own
# limit, the summary printed), then host work per plan.run (bench + profile).
set -uo pipefail
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
cd "$(dirname "$0")/../.."
T0=$(date +%s)
run() {  # run LIMIT NAME pytest-args...
  local limit=$1 name=$2; shift 2
  echo; echo "=== $name (t=$(( $(date +%s) - T0 )) s)"
  timeout -s KILL "$limit" python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider -rfE --durations=5 "$@" > $OUT/$name.log 2>&1
  echo "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Error:|[0-9.]+s (call|setup)" $OUT/$name.log | tail -14
}
run 75 t-plans tests/test_plans.py tests/test_triton_kernel.py tests/test_overlap.py
run 100 t-shard tests/test_shard_attention.py tests/test_sharded_distributed.py
run 110 t-dsa tests/test_dsa_gpu.py
echo; echo "=== plan (t=$(( $(date +%s) - T0 )) s)"
timeout -s KILL 40 python3 -m cpattn.bench plan --seqs 16384 --cps 8 --backends triton --calls 200 --out $OUT/plan > $OUT/plan.log 2>&1; tail -6 $OUT/plan.log
timeout -s KILL 45 python3 tools/gpu/profile_host.py > $OUT/profile.log 2>&1; grep -E "host|tottime" -A 9 $OUT/profile.log | head -60
echo "=== done (t=$(( $(date +%s) - T0 )) s)"
