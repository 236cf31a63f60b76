#!/usr/bin/env bash
# Session 7, fifth and sixth calls (run as one-line commands; kept here as the record): the GQA
# split target 6 vs the default 12 over the C = 1 / 8, B = 1 / 8, L = 128k / 1M table, the issue-14
# decode kernel table after the host changes, and the new direct-launch test of a decode step.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
for pps in 6 12; do
  timeout -s KILL 110 python3 -m cpattn.bench decode --shapes gqa --cps 1,8 --batches 1,8 --keys 128k,1m \
    --q-lens 1,4 --iters 20 --no-crossover --programs-per-sm $pps --out $OUT/gqa-pps$pps > /tmp/g.log 2>&1
  echo "pps $pps rc $?"; grep -E "^\| gqa" /tmp/g.log | cut -c1-150
done
timeout -s KILL 240 python3 -m cpattn.bench kernel --workloads decode --decode-batches 8,64 --decode-lens 4096,32768 \
  --backends triton --iters 10 --out $OUT/kernel-decode-h200-s7 > $OUT/kernel-decode-h200-s7.log 2>&1
timeout -s KILL 220 python3 -m pytest -v -m gpu -n 2 -p no:cacheprovider -rfE tests/test_host_launch_gpu.py \
  -k "decode_step" > $OUT/gpu-tests-h200-s7e.log 2>&1
