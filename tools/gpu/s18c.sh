#!/usr/bin/env bash
# Fourteenth session, within 30 s of s18b.sh (carry [".gpu/fa4-2"]): the source s18b chose (the tree
# with L2 sequence groups, or no_seq_groups.patch on it), FA4 install, then issue 14's whole table
# with FA4 in one run (s18b ran the GPU tests on the tree).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
choice=$(cat /tmp/s18-choice.txt 2>/dev/null || echo drop)
if [ "$choice" = keep ]; then patches=(); else patches=(no_seq_groups); fi
. tools/gpu/_table14.sh
final_table14 kernel14-fa4-h200-s18 "${patches[@]}"
