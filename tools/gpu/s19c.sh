#!/usr/bin/env bash
# Fifteenth session: every GPU test of the suite (pytest -m gpu, 8 workers) on the tree of 0.3.11
# (the MLA kernel without ptxas's injected wait), one hard limit of 540 s; log
# $OUT/gpu-tests-h200-session19.log, the 25 slowest tests at its end.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s19c-lines.txt
T=$OUT/gpu-tests-h200-session19.log; : > "$T"
PYTHONPATH=src:tools/gpu run_tests all 540 tests --durations=25 | tee -a "$L"
tail -40 "$T" | grep -E "passed|failed|s call" | tail -30
