#!/usr/bin/env bash
# Sixteenth session, within 30 s of s20b.sh (which stages FA4 part 1; carry [".gpu/fa4-2"]): FA4
# install, issue 14's whole table with FA4 in one run on the tree (0.3.12 when written) + the given patches
# (s20a adopted mla_pv_first_paged: decode's key-loop order for paged MLA prefill). STEM=NAME
# names the output files (default kernel14-fa4-h200-s20c).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
. tools/gpu/_table14.sh
final_table14 "${STEM:-kernel14-fa4-h200-s20c}" "$@"
