#!/usr/bin/env bash
# Prepared in the eleventh session, not run: first call of the next session. FA4 stage 1 (carry
# [".gpu/fa4-1"]; stage FA4 here first: ../shared/gpu/fa4/stage-here), then the triton side of
# the profile s15b.sh takes with FA4: Nsight Compute over one call per workload (the ncu metric
# names for wgmma on this chip are listed first, for s15b's --metrics).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
bash .gpu/fa4-1/stage.sh
ncu --query-metrics --chip gh100 2>/dev/null | grep -iE "gmma|tensor_op" | head -20
. tools/gpu/_ncu.sh
ncu_dense $OUT/ncu-dense-triton triton
