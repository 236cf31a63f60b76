#!/usr/bin/env bash
# Fourteenth session: L2 sequence groups in the tile order (0.3.10's _tiles.l2_group_keys). Where one
# KV head's K/V over the whole batch exceeds the L2 budget (the short batches: 131072 keys x 512 B =
# 64 MiB at D128), heaviest first over the batch runs tiles of every sequence at once, and a CPU
# LRU model of the persistent walk (50 MB of L2) misses 11% (32 x 4096) to 45% (128 x 1024) of key
# blocks; by groups of the budget's keys, 1.5-6%. (1) GPU tests on the tree (the Hopper file and
# test_triton_kernel.py's GPU tests, whose L2 budget of 1 byte puts every sequence in its own group);
# (2) A/B of the tree against no_seq_groups.patch: short batches 1024 x 128 .. 8 x 16384 with
# --clocks (SM clock and power per row), two interleaved repeats; ab_ratios.py's verdict (the rule
# fixed before the runs) into /tmp/s18-choice.txt for s18c.sh; (3) FA4 stage 1 (carry .gpu/fa4-1).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s18b-lines.txt
T=$OUT/gpu-tests-h200-session15a.log; : > "$T"
PYTHONPATH=src:tools/gpu run_tests hopper 200 tests/test_triton_hopper_gpu.py | tee -a "$L"
PYTHONPATH=src run_tests kernel 150 tests/test_triton_kernel.py | tee -a "$L"
make_variant /tmp/nog no_seq_groups
SHORT=1024x128,128x1024,64x2048,32x4096,16x8192,8x16384
for rep in 1 2; do
  for tree in /tmp/nog/src src; do
    name=groups; [ "$tree" = src ] || name=nogroups
    ab "short rep $rep" $tree --workloads short --short $SHORT --clocks
    cp /tmp/g.json "$OUT/short-$name-rep$rep.json" 2>/dev/null
    python3 -c "
import json
print('  clocks $name rep $rep: ' + ' | '.join(f\"{r['workload'].replace('d128 ', '')} {r.get('sm_mhz', 0):.0f} MHz \"
      f\"{r.get('watts', 0):.0f} W\" for r in json.load(open('/tmp/g.json'))))" | tee -a $L
  done
done
cp $L $OUT/
python3 tools/gpu/ab_ratios.py $L /tmp/nog/src src | tee /tmp/s18b-ratios.txt
grep -q "verdict: keep" /tmp/s18b-ratios.txt && echo keep > /tmp/s18-choice.txt || echo drop > /tmp/s18-choice.txt
echo "choice: $(cat /tmp/s18-choice.txt)"
bash .gpu/fa4-1/stage.sh
