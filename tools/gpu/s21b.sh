#!/usr/bin/env bash
# Prepared in the sixteenth session: the MLA kernel's epilogue stores its output in the wgmma
# accumulator layout, 8-byte (fp32 decode partials) or 4-byte (bf16) pieces per thread: 64 stores
# per thread per tile; Nsight Compute (s19e) showed decode B = 8 over 4k keys q1 with 1.53 lg-throttle
# stalls per issue (0.30 at B = 64), where a program's fixed cost (12.5 us) is a third of its time.
# mla_staged_epilogue.patch stages the output through the warpgroup's value buffers (free after
# l_bar) and stores 16 bytes per thread, a whole row per warp: offline, the decode build's global
# stores go from 128 STG.E.64 + 132 STG.E to 96 STG.E.128 + 4 STG.E, same registers (168), same
# shared memory, no new spill, no injected wait. (1) the MLA / DSA GPU tests on the patched copy
# (s20b's selection); (2) A/B against the tree, two interleaved repeats: decode B = 8, 64 over 4k /
# 32k keys q1 / q4 (graph replay) and MLA prefill (back to back); ab_ratios.py's verdict. No FA4, no
# carry; about 7 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s21b-lines.txt
variant_tests mse 230 mla_staged_epilogue -- "${MLA_TESTS[@]}"
ab_mla src /tmp/mse/src
