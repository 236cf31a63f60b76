#!/usr/bin/env bash
# Fourteenth session, within 30 s of s18f.sh (carry [".gpu/fa4-2"]), only if s18f kept the patch:
# the tree with named_ring_per_item.patch, FA4 install, issue 14's whole table with FA4 in one run.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
choice=$(cat /tmp/s18-nrp.txt 2>/dev/null || echo drop)
if [ "$choice" = keep ]; then patches=(named_ring_per_item); else patches=(); fi
. tools/gpu/_table14.sh
final_table14 kernel14-fa4-h200-s18g "${patches[@]}"
