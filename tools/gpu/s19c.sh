#!/usr/bin/env bash
# Fifteenth session: every GPU test of the suite (pytest -m gpu, 8 workers) on the tree of 0.3.11
# (the MLA kernel without ptxas's injected wait), one hard limit of 540 s; log
# $OUT/gpu-tests-h200-session19.log, the 25 slowest tests at its end.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s19c-lines.txt
every_gpu_test session19 src 540 25
