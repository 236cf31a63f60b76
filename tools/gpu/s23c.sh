#!/usr/bin/env bash
# Nineteenth session, within 30 s of s23b.sh (carry [".gpu/fa4-2"]): FA4 install, then Nsight
# Compute of one call each of triton and FA4 at d128 16k C = 4, 16k C = 8 (where triton trails FA4
# by ~8%) and 64k C = 4 (where it leads), with the SMs' active-cycle spread (min / avg / max of
# sm__cycles_active against the elapsed cycles: idle SMs in the tail and at the launch versus
# a slower key loop), then d128 zigzag 16k / 64k C = 1..8 with FA4 in one run (the D128 ratios on
# the 0.3.15 tree). About 6 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
. tools/gpu/_ncu.sh
NCU_WORKLOADS="d128 S=16k zigzag C=4,d128 S=16k zigzag C=8,d128 S=64k zigzag C=4"
NCU_EXTRA_METRICS=sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg,sm__cycles_elapsed.max
ncu_dense "$OUT/ncu-d128-s23c" triton,fa4 "--shapes d128 --seqs 16384,65536 --cps 4,8 --no-interleave"
rm -f "$OUT/ncu-d128-s23c.ncu-rep"
timeout -s KILL 200 python3 -m cpattn.bench kernel --workloads dense --shapes d128 --seqs 16384,65536 \
  --cps 1,2,4,8 --no-interleave --backends triton,fa4 --iters 5 --out "$OUT/dense-d128-fa4-s23c" \
  > "$OUT/dense-d128-fa4-s23c.log" 2>&1
echo "kernel rc $?"
grep -E "^\| d128|median" "$OUT/dense-d128-fa4-s23c.log" | cut -c1-150
