#!/usr/bin/env bash
# Fourteenth session, within 30 s of s18d.sh (carry [".gpu/fa4-2"]): the L2 budget s18d chose (the
# tree's two thirds, or l2_budget_3th / _8th.patch), FA4 install, then issue 14's whole table with
# FA4 in one run.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
budget=$(cat /tmp/s18-budget.txt 2>/dev/null || echo tree)
if [ "$budget" = tree ]; then patches=(); else patches=(l2_budget_${budget}th); fi
. tools/gpu/_table14.sh
final_table14 kernel14-fa4-h200-s18e "${patches[@]}"
