#!/usr/bin/env bash
# Session 6, call 3 (issue 12): the sparse loader's L2 prefetch of the rows it gathers next.
# DSA GPU tests (prefetch off / 2 / 5 blocks ahead give the same bits), then the sparse bench
# with prefetch distances in both orders (the order effect seen so far) and GPU clocks sampled.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session6-prefetch.log
. tools/gpu/_tests.sh
run_tests dsa 100 tests/test_dsa_gpu.py
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
  --format=csv -lms 500 > $OUT/smi.csv 2>&1 &
SMI=$!
for opts in "l2_prefetch=0;l2_prefetch=2;l2_prefetch=4" "l2_prefetch=4;l2_prefetch=2;l2_prefetch=0"; do
  timeout -s KILL 150 python3 -m cpattn.bench sparse --iters 10 --warmup 2 --families mla --sparse-options "$opts" \
    --out $OUT/sparse-prefetch-${opts:12:1} > /tmp/s.log 2>&1
  echo "[$opts] rc $?"; grep -E "^S=.*sparse" /tmp/s.log | cut -c1-160
done
timeout -s KILL 100 python3 -m cpattn.bench sparse --iters 10 --warmup 2 --families mla --seqs 131072,131072 \
  --sparse-options "l2_prefetch=0;l2_prefetch=2" --no-plot --out /tmp/sp128 > /tmp/s.log 2>&1
echo "[128k twice] rc $?"; grep -E "^S=.*sparse" /tmp/s.log | cut -c1-160
kill $SMI
awk -F, 'NR>1 {print $2,$4,$5,$6}' $OUT/smi.csv | sort | uniq -c | sort -rn | head -12
