#!/usr/bin/env bash
# Prepared in the seventeenth session: programmatic dependent launch (PDL) between the split-KV
# kernel and its combine (split_combine_pdl.patch): the split kernels (the MLA decode kernel when a
# combine follows, the portable split kernel on sm >= 90) execute griddepcontrol.launch_dependents
# at their start, the combine is launched with launch_pdl and reads its plan tables before
# griddepcontrol.wait, the partials after it; so the combine's launch and table reads overlap the
# split kernel's last programs (decode B = 8 over 4k keys q1 is 33.2 us split + 4.2 us combine:
# s19d). Offline (sm_90a): the MLA decode build keeps 168 registers, no spill, one PREEXIT added.
# (1) the decode / shard / planned-launch / plan GPU tests and the static-plan graph replays on the
# patched copy;
# (2) A/B against the tree, two interleaved repeats: MLA decode B = 1, 8 over 4k / 32k keys
# q1 / q4 (graph replay) and one rank's shard step of GQA and MLA at C = 1 / 8, B = 1 / 8 over 4k /
# 32k keys q1 (8 layers in one graph); ab_ratios.py's verdict. No FA4, no carry; about 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s22a-lines.txt
variant_tests pdl 200 split_combine_pdl -- tests/test_shard_attention.py tests/test_host_launch_gpu.py \
  tests/test_sharded_distributed.py tests/test_merge_kernels.py tests/test_plans.py \
  tests/test_triton_hopper_gpu.py::test_gpu_static_plan_graph_replay
for rep in 1 2; do
  for tree in src /tmp/pdl/src; do
    AB_LIMIT=120 ab_graph "decode rep $rep" "$tree" --workloads decode --decode-batches 1,8 \
      --decode-lens 4096,32768 --decode-qlens 1,4
    ab_layers "layers rep $rep" "$tree"
  done
done
cp "$L" "$OUT/"
python3 tools/gpu/ab_ratios.py "$L" src /tmp/pdl/src
