# Sourced by the GPU session scripts: issue14_table STEM LIMIT runs issue 14's whole kernel table
# with FA4 in one run (dense / paged / MLA / decode / short, sustained timing) into $OUT/STEM.{json,
# png,log} under a hard time limit and prints its summary lines (s12d.sh, s13c.sh, s16d.sh).
issue14_table() {
  local stem=$1 limit=$2
  timeout -s KILL "$limit" python3 -m cpattn.bench kernel --workloads dense,paged,mla,decode,short \
    --shapes d128,d192 --seqs 16384,65536,131072 --cps 1,2,4,8 --pages 16,64,256 --no-interleave \
    --backends triton,fa4 --iters 5 --short 1024x128,128x1024,64x2048,32x4096 --warmup-ms 200 --min-ms 50 \
    --out "$OUT/$stem" > "$OUT/$stem.log" 2>&1
  echo "kernel rc $? [$(date +%T)]"
  grep -E "^  " "$OUT/$stem.log" | sed 's/(target[^)]*)//g' | cut -c1-150 | head -90
}

# source_tests_table14 SRC CALL STEM: FA4 install (the second staging call), then on the source
# SRC: the Hopper GPU tests (log $OUT/gpu-tests-h200-CALL.log) and issue 14's whole table into
# $OUT/STEM.* (s13c.sh, s16d.sh).
source_tests_table14() {
  local src=$1 call=$2 stem=$3
  . tools/gpu/_fa4.sh
  export PYTHONPATH=$src:$PYTHONPATH
  T=$OUT/gpu-tests-h200-$call.log; : > "$T"
  . tools/gpu/_tests.sh
  PYTHONPATH=$PYTHONPATH:tools/gpu run_tests hopper 200 tests/test_triton_hopper_gpu.py
  issue14_table "$stem" 360
}

# final_table14 STEM [PATCH...] (the second call of an FA4 pair, within 30 s of the staging one):
# make_variant /tmp/final with the patches (none: the tree), FA4 install, then issue 14's whole
# table on /tmp/final (s18c.sh, s18e.sh, s18g.sh).
final_table14() {
  local stem=$1; shift
  make_variant /tmp/final "$@"
  echo "source: tree${*:+ + $*}"
  . tools/gpu/_fa4.sh
  export PYTHONPATH=/tmp/final/src:$PYTHONPATH
  issue14_table "$stem" 360
}
