#!/usr/bin/env bash
# Session 8, fifth call (issue 14; 11): MLA decode kernel table with float32 split partials (the
# default) and 16-bit ones (partial_dtype=auto), twice each, alternating; the shard GPU tests with
# the new option; host µs per plan.run in rounds after the per-call trims. The partial_dtype
# option this ran with was removed after it (16-bit partials were slower at B = 8 L = 4k).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s8e.log; : > "$T"
. tools/gpu/_tests.sh
for rep in 1 2; do
  for pd in float32 auto; do
    timeout -s KILL 90 python3 -m cpattn.bench kernel --workloads decode --decode-batches 1,8,64 \
      --decode-lens 4096,32768 --backends triton --iters 10 --decode-options partial_dtype=$pd \
      --out $OUT/kernel-decode-partials-$pd-$rep > /tmp/kd.log 2>&1
    echo "decode partials $pd run $rep rc $?"
    python3 - "$OUT/kernel-decode-partials-$pd-$rep.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"] if isinstance(d, dict) else d
print("  " + " | ".join(f"{r['workload'].replace('mla576 decode ', '')} {r['tflops']:.0f}/{r['tflops_graph']:.0f}"
                        for r in rows))
PY
  done
done
rm -f $OUT/kernel-decode-partials-*-2.png $OUT/kernel-decode-partials-*-1.png
run_tests shard 240 tests/test_shard_attention.py
timeout -s KILL 80 python3 tools/gpu/host_rounds.py > $OUT/host-rounds-h200-s8e.log 2>&1
echo "rounds rc $?"; tail -6 $OUT/host-rounds-h200-s8e.log | cut -c1-230
