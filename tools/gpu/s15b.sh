#!/usr/bin/env bash
# Prepared in the eleventh session, not run: second call (within 30 s of s15a.sh, carry
# [".gpu/fa4-2"]): FA4 install, then Nsight Compute over one triton and one FA4 call of the
# points where triton trails FA4 most (16k C = 1 at d128 / d192) and their C = 2 neighbours:
# duration, SM / tensor-pipe / DRAM throughput, occupancy, warp stall reasons, L2 hit rate.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
. tools/gpu/_ncu.sh
ncu_dense $OUT/ncu-dense triton,fa4
