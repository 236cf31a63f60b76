#!/usr/bin/env bash
# Fifteenth session, within 30 s of s19a.sh (carry [".gpu/fa4-2"]): FA4 install, issue 14's whole
# table with FA4 in one run on the tree (0.3.11: the MLA kernel without ptxas's injected wait).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
. tools/gpu/_table14.sh
final_table14 kernel14-fa4-h200-s19b
