#!/usr/bin/env bash
# Sixteenth session, last call (~400 s of device time left): the tree at 0.3.13 (both s20a's
# mla_pv_first_paged and s20b's mla_chunk_ready, each measured alone against 0.3.12, never
# together on the GPU): (1) the MLA / DSA GPU tests (s20b's selection); (2) MLA prefill 16k C = 1
# packed and over pages of 16 / 64 / 256, and decode B = 8 / 64 over 4k keys q1 / q4 (graph replay),
# one run each, for the combination's numbers. No FA4, no carry.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s20d-lines.txt
variant_tests both 200 -- "${MLA_TESTS[@]}"
ab "prefill" src --workloads mla --mla-seqs 16384 --mla-cps 1 --mla-pages 16,64,256
AB_LIMIT=60 ab_graph "decode" src --workloads decode --decode-batches 8,64 --decode-lens 4096 --decode-qlens 1,4
cp $L $OUT/
