#!/usr/bin/env bash
# The consolidated H200 run of this session: every GPU test (xdist: the Gluon / Triton compiles
# run in parallel), then the benchmarks of issues 11-14 at reduced sizes. Every step has its own
# hard time limit so one hang cannot take the others with it; logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
cd "$(dirname "$0")/../.."
T0=$(date +%s)
step() { echo; echo "=== $1 (t=$(( $(date +%s) - T0 )) s)"; }
step tests-core
timeout -s KILL 170 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_plans.py tests/test_triton_kernel.py \
  tests/test_shard_attention.py tests/test_sharded_distributed.py tests/test_dsa_gpu.py tests/test_overlap.py \
  > $OUT/tests-core.log 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/tests-core.log | tail -25
step tests-hopper
timeout -s KILL 125 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_hopper_gpu.py \
  > $OUT/tests-hopper.log 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/tests-hopper.log | tail -25
step plan
timeout -s KILL 40 python3 -m cpattn.bench plan --seqs 16384 --cps 8 --backends triton --calls 200 --out $OUT/plan \
  > $OUT/plan.log 2>&1; tail -6 $OUT/plan.log
step kernel
timeout -s KILL 110 python3 -m cpattn.bench kernel --workloads dense,paged,mla,decode,short --shapes d128 --seqs 65536 \
  --cps 1,8 --no-interleave --pages 16,64,256 --mla-seqs 16384 --decode-lens 32768 --backends triton,sdpa --iters 5 \
  --out $OUT/kernel > $OUT/kernel.log 2>&1; grep -v "^\[" $OUT/kernel.log | tail -40; grep "TF/s" $OUT/kernel.log | tail -3
step sparse
timeout -s KILL 60 python3 -m cpattn.bench sparse --iters 5 --warmup 2 --out $OUT/sparse > $OUT/sparse.log 2>&1; tail -14 $OUT/sparse.log
step decode
timeout -s KILL 65 python3 -m cpattn.bench decode --cps 1,8 --batches 1,8,64 --keys 128k,1m --q-lens 1 --iters 5 \
  --crossover-prefixes 0,16k,256k,1m --out $OUT/decode > $OUT/decode.log 2>&1; tail -30 $OUT/decode.log
step done
