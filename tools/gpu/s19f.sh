#!/usr/bin/env bash
# Fifteenth session: s19e's Nsight Compute profile showed the MLA decode kernel's warps waiting
# (long scoreboard 12.3 per issue against prefill's 8.8; tensor pipe 44% active against 63%) with
# its latent read from DRAM once (1.77 TB/s): with two stages, block j + 2's load starts only when
# the other warpgroup has added P_j V_j, late in its next iteration. mla_decode_pv_first.patch gives
# decode the sparse mode's order (the other warpgroup's P_{j-1} V_{j-1} before waiting for block
# j), which frees a stage one Q K^T earlier. (1) the MLA / DSA GPU tests on the patched copy
# (without the 128k case); (2) A/B against the tree: MLA decode B = 8, 64 over 4k / 32k keys,
# q1 / q4, graph-replay TF/s, two interleaved repeats; MLA prefill is the same code (DECODE = 0).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s19f-lines.txt
make_variant /tmp/pvf mla_decode_pv_first
T=$OUT/gpu-tests-h200-pvf.log; : > "$T"
PYTHONPATH=/tmp/pvf/src:tools/gpu run_tests pvf 230 tests/test_triton_hopper_gpu.py tests/test_dsa_gpu.py \
  tests/test_shard_attention.py -k "mla and not test_gpu_split_kv_at_128k or test_dsa_gpu" | tee -a "$L"
for rep in 1 2; do
  for tree in src /tmp/pvf/src; do
    rm -f /tmp/g.json
    PYTHONPATH=$tree timeout -s KILL 100 python3 -m cpattn.bench kernel --backends triton --iters 5 --out /tmp/g \
      --workloads decode --decode-batches 8,64 --decode-lens 4096,32768 --decode-qlens 1,4 > /tmp/g.log 2>&1
    rc=$?; [ $rc = 0 ] || tail -5 /tmp/g.log
    echo "decode rep $rep $tree rc $rc $(python3 -c "
import json; rows = json.load(open('/tmp/g.json'))
print(' | '.join(f\"{r['workload'].replace('mla576 ', '')} {r.get('tflops_graph', 0):.0f}\" for r in rows))")" | tee -a $L
  done
done
cp $L $OUT/
python3 tools/gpu/ab_ratios.py $L src /tmp/pvf/src
