#!/usr/bin/env bash
# Prepared in the fifteenth session, run in the sixteenth (kept: 0.3.13; a record now, its patch is
# in the tree). After 0.3.12 a decode block's load may still sit on
# the critical path (the consumer waits for the whole 72 KB block before its first Q K^T wgmma).
# mla_chunk_ready.patch gives each latent stage three ready barriers in the TMA modes (columns
# 0-255, 256-511, the rope part; packed and paged loaders), so Q K^T starts on the first third
# while the rest lands. Offline: every MLA build compiles with the same registers, no new spill,
# no C7517. (1) the MLA / DSA GPU tests on the patched copy (s19f's selection, 230 s); (2) A/B
# against the tree, two interleaved repeats: decode B = 8, 64 over 4k / 32k keys q1 / q4 (graph
# replay) and MLA prefill 16k / 64k C = 1, 4 + paged 64 (back to back); ab_ratios.py's verdict
# over both. No FA4, no carry; about 7 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s20b-lines.txt
variant_tests mcr 230 mla_chunk_ready -- "${MLA_TESTS[@]}"
ab_mla src /tmp/mcr/src  # (as run in the sixteenth session: the same loop, inline)
bash .gpu/fa4-1/stage.sh
