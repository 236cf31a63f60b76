#!/usr/bin/env bash
# Nineteenth session: FA4 stage 1 only (carry [".gpu/fa4-1"]), for issue 14's table on the 0.3.15
# tree that follows within 30 s: STEM=kernel14-fa4-h200-s23f bash tools/gpu/s20c.sh (carry
# [".gpu/fa4-2"]).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-1/stage.sh
