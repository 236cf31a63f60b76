#!/usr/bin/env bash
# Thirteenth session, within 30 s of s17c.sh (carry [".gpu/fa4-2"]): is the dense gap to FA4 a gap
# of work per clock or of clock? Under the benchmark's sustained timing the H200 runs against its
# 700 W cap, so a kernel that spends more energy per FLOP runs at a lower SM clock. nvidia-smi
# samples SM clock / power every 100 ms while the benchmark times triton and FA4 (d128 and d192,
# 16k / 64k, zigzag C = 1, 2; 1.5 s warm-up per backend and workload, two runs in opposite
# backend order); tools/gpu/clock_probe.py attributes the samples to each result.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
F=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.sw_power_cap,clocks_throttle_reasons.sw_thermal_slowdown
nvidia-smi --query-gpu=$F --format=csv,noheader,nounits > /dev/null 2>&1 || F=timestamp,clocks.sm,power.draw,temperature.gpu
echo "nvidia-smi fields: $F"
for order in triton,fa4 fa4,triton; do
  stem=clocks-${order/,/-}
  nvidia-smi --query-gpu=$F --format=csv,noheader,nounits -lms 100 > $OUT/$stem-smi.csv 2>&1 &
  smi=$!
  timeout -s KILL 200 python3 -m cpattn.bench kernel --workloads dense --shapes d128,d192 --seqs 16384,65536 \
    --cps 1,2 --no-interleave --no-paged --backends $order --iters 5 --warmup-ms 1500 --min-ms 500 \
    --out $OUT/$stem > $OUT/$stem.log 2>&1
  echo "bench $order rc $?"
  kill $smi; wait $smi 2>/dev/null
  python3 tools/gpu/clock_probe.py $OUT/$stem.log $OUT/$stem-smi.csv $OUT/$stem-probe.json
done
