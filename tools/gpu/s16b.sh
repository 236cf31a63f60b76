#!/usr/bin/env bash
# Twelfth session: where the consumers of the dense sm90 kernel wait, per SASS instruction.
# Nsight Compute's source counters (sampled warp stall reasons per instruction) over one triton
# call of d128 and d192 16k C = 1 (the tree), exported as CSV (--page source --print-source sass)
# for reading back without ncu.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
for w in "d128 S=16k zigzag C=1" "d192 S=16k zigzag C=1"; do
  stem=$OUT/src-$(echo "$w" | cut -d' ' -f1)
  timeout -s KILL 200 ncu --profile-from-start off --clock-control none --section SourceCounters \
    --section WarpStateStats -o "$stem" -f python3 tools/gpu/ncu_dense.py --workloads "$w" --backends triton \
    > /tmp/ncu.log 2>&1
  echo "$w: ncu rc $?"; grep -E "^profiled|rror" /tmp/ncu.log | head -5
  ncu --import "$stem.ncu-rep" --page source --csv --print-source sass > "$stem-sass.csv" 2>&1
  ncu --import "$stem.ncu-rep" --page details --csv > "$stem-details.csv" 2>&1
  ls -la "$stem"*; head -c 600 "$stem-sass.csv"; echo
done
