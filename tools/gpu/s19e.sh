#!/usr/bin/env bash
# Fifteenth session: why the absorbed-MLA decode kernel's steady rate (2.6 µs per 64-key block at
# B = 8 / 64, ~450 TF/s) trails the same kernel's prefill (~2.1 µs per block, ~560 TF/s), and
# where B = 8 over 4k keys spends its ~12 µs fixed per program: Nsight Compute over one call each
# of MLA prefill 16k C = 1 and decode B = 64 / B = 8 over 4k keys q1 (0.3.11), the sections of
# _ncu.sh (speed of light, launch, occupancy, warp state, scheduler, compute, memory).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
. tools/gpu/_ncu.sh
NCU_WORKLOADS="mla576 S=16k zigzag C=1,mla576 decode B=64 L=4k q1,mla576 decode B=8 L=4k q1"
ncu_dense $OUT/ncu-mla triton "--mla-seqs 16384 --mla-cps 1 --decode-batches 8,64 --decode-lens 4096 --decode-qlens 1 --no-paged"
cat /tmp/ncu.log | grep -v "^==PROF==" | tail -8
