#!/usr/bin/env bash
# Ninth session: overlap=2 (the committed, ungated wait) against the default overlap=0 beyond
# s12a's d128 dense points: d192 and d64 dense zigzag, paged (64k, pages 16 / 64 / 256, with the
# packed baseline) and interleave C=4, sustained timing, two interleaved repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
ab() {  # ab LABEL OPTIONS bench-args...
  local label=$1 opts=$2; shift 2
  rm -f /tmp/g.json
  timeout -s KILL 100 python3 -m cpattn.bench kernel --backends triton --iters 5 --sm90-options "$opts" \
    --out /tmp/g "$@" > /tmp/g.log 2>&1
  local rc=$?; [ $rc = 0 ] || tail -5 /tmp/g.log
  echo "$label $opts rc $rc $(python3 -c "
import json; rows = json.load(open('/tmp/g.json'))
print(' | '.join(f\"{r['workload'].replace(' zigzag', '')} {r['tflops']:.0f}\" for r in rows))")"
}
for rep in 1 2; do
  for o in overlap=0 overlap=2; do
    ab "d192 rep $rep" $o --workloads dense --shapes d192 --seqs 16384,65536,131072 --cps 1,2,4,8 --no-interleave
    ab "d64 rep $rep" $o --workloads dense --shapes d64 --seqs 16384,65536,131072 --cps 1,2,4,8 --no-interleave
  done
done
for rep in 1 2; do
  for o in overlap=0 overlap=2; do
    ab "paged rep $rep" $o --workloads paged --shapes d128,d192 --seqs 65536
    ab "inter rep $rep" $o --workloads interleave --shapes d128,d192 --seqs 16384,65536 --cps 1 --no-paged
  done
done
