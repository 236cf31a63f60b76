# Sourced by the GPU session scripts (A/B calls start with ". tools/gpu/_variant.sh; ab_session FILE").
# ab_session FILE: the timing settings every A/B call uses, run_tests (_tests.sh), and FILE (emptied)
# as $L, the file the saved lines go to (choose_patches.py, ab_ratios.py, choose_s16.py read it).
ab_session() {
  L=$1; : > "$L"
  export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
  . tools/gpu/_tests.sh
}

# make_variant DIR [PATCH...] copies src to DIR/src and applies
# the named patches of tools/gpu/patches/ in order (tests/test_kernel_patches_apply.py checks they
# apply); exits the script if one does not.
make_variant() {
  local dir=$1; shift
  rm -rf "$dir" && mkdir -p "$dir" && cp -r src "$dir/" || { echo "copy to $dir failed"; exit 1; }
  for p in "$@"; do
    patch -s -d "$dir/src" -p2 < "tools/gpu/patches/$p.patch" || { echo "patch $p failed"; exit 1; }
  done
}

# variant_hopper_tests NAME PATCH...: make_variant /tmp/NAME with the patches, then the Hopper GPU
# tests on it (run_tests of _tests.sh, 200 s, log $OUT/gpu-tests-h200-NAME.log); the summary line
# is also appended to $L (the lines choose_patches.py reads).
variant_hopper_tests() {
  local name=$1; shift
  variant_tests "$name" 200 "$@" -- tests/test_triton_hopper_gpu.py
}

# MLA_TESTS: the MLA / DSA GPU test selection (the Hopper file's and shard attention's MLA tests but
# the 128k split, and the DSA tests), as pytest arguments: "${MLA_TESTS[@]}" (s18h ... s21b).
MLA_TESTS=(tests/test_triton_hopper_gpu.py tests/test_dsa_gpu.py tests/test_shard_attention.py
           -k "mla and not test_gpu_split_kv_at_128k or test_dsa_gpu")

# variant_tests NAME LIMIT PATCH... -- PYTEST-ARGS...: make_variant /tmp/NAME with the patches, then
# the GPU tests PYTEST-ARGS select on it (run_tests of _tests.sh, LIMIT s, log
# $OUT/gpu-tests-h200-NAME.log); the summary line is also appended to $L.
variant_tests() {
  local name=$1 limit=$2 patches=(); shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do patches+=("$1"); shift; done
  shift
  make_variant "/tmp/$name" "${patches[@]}"
  T=$OUT/gpu-tests-h200-$name.log; : > "$T"
  PYTHONPATH=/tmp/$name/src:tools/gpu run_tests "$name" "$limit" "$@" | tee -a "$L"
}

# ab LABEL TREE bench-args...: one triton run of python -m cpattn.bench kernel on the source TREE
# (${AB_LIMIT:-80} s limit); prints and appends to $L one line "LABEL TREE rc N workload TF/s | ..."
# (the lines choose_patches.py and ab_ratios.py read). ab_graph: the same with the decode rows'
# graph-replay TF/s (how engines run decode steps).
ab() { ab_field tflops "$@"; }
ab_graph() { ab_field tflops_graph "$@"; }

ab_field() {
  local field=$1 label=$2 tree=$3; shift 3
  rm -f /tmp/g.json
  PYTHONPATH=$tree timeout -s KILL "${AB_LIMIT:-80}" python3 -m cpattn.bench kernel --backends triton --iters 5 \
    --out /tmp/g "$@" > /tmp/g.log 2>&1
  local rc=$?; [ $rc = 0 ] || tail -5 /tmp/g.log
  echo "$label $tree rc $rc $(python3 -c "
import json; rows = json.load(open('/tmp/g.json'))
print(' | '.join(f\"{r['workload'].replace(' zigzag', '').replace('d128 ', '')} {r.get('$field', 0):.0f}\" for r in rows))")" | tee -a $L
}

# ab_layers LABEL TREE: one rank's shard step (python -m cpattn.bench decode), GQA and MLA, C = 1 and 8,
# B = 1 / 8 over 4k / 32k keys q1 on the source TREE: the attention of 8 layers captured in one CUDA
# graph (as in an engine's step graph), per layer, as layer calls per millisecond (higher is
# better, so ab_ratios.py reads it like TF/s); appends one line to $L (s22a, s22d).
ab_layers() {
  local label=$1 tree=$2
  rm -f /tmp/d.json
  PYTHONPATH=$tree timeout -s KILL 150 python3 -m cpattn.bench decode --shapes gqa,mla --cps 1,8 --batches 1,8 \
    --keys 4k,32k --q-lens 1 --no-crossover --iters 10 --out /tmp/d > /tmp/d.log 2>&1
  local rc=$?; [ $rc = 0 ] || tail -5 /tmp/d.log
  echo "$label $tree rc $rc $(python3 -c "
import json; rows = json.load(open('/tmp/d.json'))
rows = rows['rows'] if isinstance(rows, dict) else rows
print(' | '.join(f\"{r['shape']} C={r['cp']} B={r['batch']} L={r['keys'] // 1024}k q{r['q_len']} {1.0 / r['attn_layers_ms']:.3f}\"
                 for r in rows if r.get('attn_layers_ms')))")" | tee -a $L
}

# ab_dense_paged_short NEW: the standard A/B of the tree (src) against the source tree NEW (s16a,
# s17e): dense d128 / d192 zigzag 16k / 64k C = 1, 2, 4, 8 at the defaults, two interleaved
# repeats; then per tree paged 64k C = 2 (pages 16, 64) and short batches once (s16a ran short
# before paged); saves the lines to $L and prints ab_ratios.py's groups and verdict.
ab_dense_paged_short() {
  local new=$1
  for rep in 1 2; do
    for tree in src "$new"; do
      ab "dense rep $rep" $tree --workloads dense --shapes d128,d192 --seqs 16384,65536 --cps 1,2,4,8 --no-interleave
    done
  done
  for tree in src "$new"; do
    ab "paged rep 1" $tree --workloads paged --shapes d128,d192 --seqs 65536 --cps 2 --pages 16,64 --no-interleave
    ab "short rep 1" $tree --workloads short --short 1024x128,128x1024,64x2048,32x4096
  done
  cp $L $OUT/
  python3 tools/gpu/ab_ratios.py $L src "$new"
}

# patch_ab NAME PATCH: the Hopper tests on /tmp/NAME (the tree + PATCH), then
# ab_dense_paged_short against the tree (s16a, s23d).
patch_ab() {
  variant_hopper_tests "$1" "$2"
  ab_dense_paged_short "/tmp/$1/src"
}

# patch_ab_call NAME PATCH CHOICE: the standard A/B call of one kernel patch (s17e, s18f): the Hopper
# tests on /tmp/NAME (the tree + PATCH), ab_dense_paged_short against the tree, ab_ratios.py's
# verdict ("keep" / "drop") into the file CHOICE, then FA4 stage 1 (carry .gpu/fa4-1).
patch_ab_call() {
  local name=$1 patch=$2 choice=$3
  patch_ab "$name" "$patch" | tee "/tmp/$name-ratios.txt"
  grep -q "verdict: keep" "/tmp/$name-ratios.txt" && echo keep > "$choice" || echo drop > "$choice"
  echo "choice: $(cat "$choice")"
  bash .gpu/fa4-1/stage.sh
}

# ab_mla OLD NEW: the MLA A/B of s20b.sh / s21a.sh / s21b.sh on the sources OLD and NEW, two
# interleaved repeats of decode B = 8, 64 over 4k / 32k keys q1 / q4 (graph replay, 100 s limit)
# and `--workloads mla` (back to back); the lines copied to $OUT, ab_ratios.py's verdict (NEW
# against OLD).
ab_mla() {
  local old=$1 new=$2 rep tree
  for rep in 1 2; do
    for tree in "$old" "$new"; do
      AB_LIMIT=100 ab_graph "decode rep $rep" "$tree" --workloads decode --decode-batches 8,64 \
        --decode-lens 4096,32768 --decode-qlens 1,4
      ab "mla rep $rep" "$tree" --workloads mla
    done
  done
  cp "$L" "$OUT/"
  python3 tools/gpu/ab_ratios.py "$L" "$old" "$new"
}

# every_gpu_test NAME SRC LIMIT [DURATIONS]: every `pytest -m gpu` test of tests/ on the source
# tree SRC (run_tests of _tests.sh, LIMIT s), log $OUT/gpu-tests-h200-NAME.log ending with the
# DURATIONS (default 10) slowest tests; prints and appends the summary line to $L, then the log's
# totals and slowest tests (s19c, s21c, s22d, s24c).
every_gpu_test() {
  local name=$1 src=$2 limit=$3 durations=${4:-10}
  T=$OUT/gpu-tests-h200-$name.log; : > "$T"
  PYTHONPATH=$src:tools/gpu run_tests all "$limit" tests --durations="$durations" | tee -a "$L"
  tail -$((durations + 15)) "$T" | grep -E "passed|failed|s call"
}
