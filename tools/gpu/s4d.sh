#!/usr/bin/env bash
# Session 4, FA4 call (after `bash .gpu/fa4-1/stage.sh`): GPU tests of this session's new paths
# (planned split / combine / merge launches, MLA split-KV decode, sparse MLA family, peeled sm90
# loop, direct launches), then the kernel benchmark with FA4 in the same run (issue 14).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-2/install.sh > $OUT/fa4-install.log 2>&1 || { tail -5 $OUT/fa4-install.log; exit 1; }
. /opt/fa4site/env.sh
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import flash_attn.cute; print('fa4 importable')"
run() {  # name, limit, pytest args...
  local name=$1 limit=$2; shift 2
  timeout -s KILL "$limit" python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE "$@" > $OUT/t-$name.log 2>&1
  echo "== $name (rc $?): $(grep -cE ' PASSED' $OUT/t-$name.log) passed, $(grep -cE ' FAILED| ERROR' $OUT/t-$name.log) failed"
  grep -E "^(FAILED|ERROR) |^E  " $OUT/t-$name.log | head -16
}
run dsa 130 tests/test_dsa_gpu.py
run shard 110 tests/test_shard_attention.py tests/test_merge_kernels.py
run hopper 90 tests/test_host_launch_gpu.py tests/test_triton_hopper_gpu.py -k "direct_launch or nan_in_another or paged_vs_torch or mla_prefill or graph"
timeout -s KILL 160 python3 -m cpattn.bench kernel --workloads dense,paged,short --shapes d128,d192 --seqs 16384,65536 \
  --cps 1,2,8 --pages 16,64,256 --no-interleave --backends triton,fa4 --iters 5 --out $OUT/kernel-fa4-h200 \
  > $OUT/kernel-fa4-h200.log 2>&1
echo "kernel rc $?"; grep -v "^\[" $OUT/kernel-fa4-h200.log | tail -42
