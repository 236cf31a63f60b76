#!/usr/bin/env bash
# Every GPU test and the standard benchmark set, on a machine with CUDA GPUs (Hopper for the
# sm_90 kernels and FA4). Run from anywhere; everything it writes goes to gpu-out/ at the
# repository root (git-ignored): gpu-tests.log, one JSON / PNG / log per benchmark, summary.txt.
#
#   bash tools/gpu_suite.sh                      # GPU tests, then the benchmarks
#   bash tools/gpu_suite.sh --fa4                # stage + install FA4 from ../shared/gpu/fa4 first
#   bash tools/gpu_suite.sh --only tests         # one or more steps (comma list, in this order):
#                                                #   tests,kernel,decode,sparse,plan,metadata,mla,cp,scaling
#
# All steps take about 30 minutes on one H200 (tests ~5, kernel table ~6, the rest 1-5 each); where
# one command may run only so long, split them over calls with --only (later calls add to gpu-out/).
#
# Options:
#   --fa4 [DIR]         install FlashAttention-4 first (its wheels for the machine's python3, see
#                       DIR/README.md; DIR default ../shared/gpu/fa4 beside the repository, else the
#                       .gpu/fa4-1 / .gpu/fa4-2 copies its stage-here script makes), then put it on
#                       PYTHONPATH. Already installed (/opt/fa4site): only the latter.
#   --fa4-stage-only [DIR]
#                       only FA4's first half (part1/stage.sh) and exit: for a machine that gets the
#                       bundle in two calls (part 1, then part 2 + `--fa4` within the machine's life).
#   --only STEPS        run these steps only (default: all; the multi-GPU ones need >= 2 GPUs).
#   --test-limit S      time limit of the GPU tests (default 900 s); each benchmark has its own.
#   --workers N         pytest-xdist workers for the GPU tests (default 8 when xdist is installed).
#   --out DIR           output folder (default gpu-out at the repository root).
#   --src DIR           the cpattn source tree to test and measure (default src; e.g. a patched
#                       copy for an A/B against the tree: run once per tree with its own --out).
#
# Settings every run uses: CPATTN_TRITON_AUTOTUNE=0 (each kernel's default config is its measured
# best; the autotuner would add minutes), NVLink multicast off for NCCL, the checkout's src/ and
# root on PYTHONPATH (no install needed). Benchmark timing is the benchmarks' sustained default
# (each backend warmed up >= 200 ms, >= 50 ms per repeat), so GPUs sit at their power cap.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
FA4=0 FA4_STAGE_ONLY=0 FA4_DIR=""
ONLY="tests,kernel,decode,sparse,plan,metadata,mla,cp,scaling"
TEST_LIMIT=900 WORKERS="" OUT=gpu-out SRC=src

while [ $# -gt 0 ]; do
  case $1 in
    --fa4|--fa4-stage-only)
      [ "$1" = --fa4 ] && FA4=1 || FA4_STAGE_ONLY=1
      if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then FA4_DIR=$2; shift; fi ;;
    --only) ONLY=$2; shift ;;
    --test-limit) TEST_LIMIT=$2; shift ;;
    --workers) WORKERS=$2; shift ;;
    --out) OUT=$2; shift ;;
    --src) SRC=$2; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt  # appended to: calls split with --only add up

export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

note() { echo "[$(date +%T)] $*" | tee -a "$SUMMARY"; }

# ------------------------------------------------------------------------------- FA4
fa4_part() {  # fa4_part 1|2: the folder holding that half of the bundle, or nothing
  local n=$1 dir
  for dir in ${FA4_DIR:+"$FA4_DIR/part$n"} "$ROOT/../shared/gpu/fa4/part$n" "$ROOT/shared/gpu/fa4/part$n" \
             "$ROOT/.gpu/fa4-$n"; do
    [ -d "$dir" ] && { echo "$dir"; return; }
  done
}

fa4_stage() {
  [ -f /root/fa4-stage/cu13.tar.xz.aa ] && { note "fa4: part 1 already staged"; return 0; }
  local p1; p1=$(fa4_part 1)
  [ -n "$p1" ] || { note "fa4: part 1 not found (${FA4_DIR:-../shared/gpu/fa4}/part1, .gpu/fa4-1)"; return 1; }
  bash "$p1/stage.sh" || { note "fa4: staging part 1 failed"; return 1; }
}

fa4_install() {
  if [ ! -f /opt/fa4site/.installed ]; then
    fa4_stage || return 1
    local p2; p2=$(fa4_part 2)
    [ -n "$p2" ] || { note "fa4: part 2 not found (${FA4_DIR:-../shared/gpu/fa4}/part2, .gpu/fa4-2)"; return 1; }
    bash "$p2/install.sh" > "$OUT/fa4-install.log" 2>&1 || { note "fa4: install failed"; tail -5 "$OUT/fa4-install.log"; return 1; }
  fi
  . /opt/fa4site/env.sh
  note "fa4: installed in /opt/fa4site"
}

if [ "$FA4_STAGE_ONLY" = 1 ]; then
  fa4_stage && note "fa4: part 1 staged; now run with --fa4 while this machine lives"
  exit $?
fi
if [ "$FA4" = 1 ]; then
  fa4_install || note "fa4: not available; its tests skip and the benchmarks run without it"
fi
SRC=$(cd "$SRC" && pwd) || exit 2
export PYTHONPATH=$SRC:$ROOT${PYTHONPATH:+:$PYTHONPATH}  # after FA4's env.sh, which prepends its site

# ------------------------------------------------------------------------------- steps
want() { [[ ",$ONLY," == *",$1,"* ]]; }
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
note "$("$PY" -c "import sys, torch; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, {torch.cuda.device_count()} GPU(s):', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')" 2>&1)"
rev=""
if [ "$SRC" = "$ROOT/src" ] && rev=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null); then
  git -C "$ROOT" diff --quiet HEAD -- src || rev="$rev, src/ modified"
fi
note "cpattn from $SRC${rev:+ (commit $rev)}"
[ "$GPUS" -ge 1 ] || note "no CUDA device: the GPU tests skip and the GPU benchmarks fail"

step() {  # step NAME LIMIT COMMAND...: run under a hard limit, log to $OUT/NAME.log, note rc
  local name=$1 limit=$2; shift 2
  note "$name: $*"
  timeout -s KILL "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: rc $rc$([ $rc = 137 ] && echo " (killed at the ${limit} s limit)")"
  return $rc
}

bench() {  # bench NAME LIMIT FAMILY ARGS...: one benchmarks/run.py run into $OUT/NAME.*
  local name=$1 limit=$2 family=$3; shift 3
  step "$name" "$limit" "$PY" benchmarks/run.py "$family" "$@"
}

if want tests; then
  xdist=()
  if [ -n "$WORKERS" ] || "$PY" -c "import xdist" 2>/dev/null; then xdist=(-n "${WORKERS:-8}"); fi
  step gpu-tests "$TEST_LIMIT" "$PY" -m pytest -v -m gpu ${xdist[@]+"${xdist[@]}"} -p no:cacheprovider -rfE --durations=10
  note "gpu-tests: $(grep -cE ' PASSED' "$OUT/gpu-tests.log") passed, $(grep -cE ' FAILED| ERROR' "$OUT/gpu-tests.log") failed; $(tail -1 "$OUT/gpu-tests.log")"
  grep -E "^(FAILED|ERROR) " "$OUT/gpu-tests.log" | head -20 | tee -a "$SUMMARY"
fi

# The kernel table: dense d128 / d192 zigzag 16k-128k C = 1..8, paged 16 / 64 / 256, absorbed MLA
# prefill and decode, short batches; triton against FA4 (skipped when FA4 is not importable).
want kernel && bench kernel 540 kernel --workloads dense,paged,mla,decode,short --shapes d128,d192 \
  --seqs 16384,65536,131072 --cps 1,2,4,8 --pages 16,64,256 --no-interleave --backends triton,fa4 --iters 5 \
  --short 1024x128,128x1024,64x2048,32x4096 --out "$OUT/kernel"
# One rank's decode step (GQA and MLA, C = 1 and 8, B = 1 / 8 over 4k / 32k keys, q1): eager,
# graph replay and 10 layers per CUDA graph.
want decode && bench decode 300 decode --shapes gqa,mla --cps 1,8 --batches 1,8 --keys 4k,32k --q-lens 1 \
  --no-crossover --iters 10 --out "$OUT/decode"
# DSA: index top-k and sparse attention (Hopper MLA kernel), rank 0 of interleave C = 8, 32k / 128k.
want sparse && bench sparse 300 sparse --iters 5 --warmup 2 --families mla --fp8 --out "$OUT/sparse"
# Host work per attention call (plan.run against strategy.attention), 16k C = 8.
want plan && bench plan 120 plan --seqs 16384 --cps 8 --backends triton --calls 200 --out "$OUT/plan-host"
# Host cost of build_metadata (on this machine's CPU; plan upload to the GPU).
want metadata && bench metadata 300 metadata --out "$OUT/metadata"
if [ "$GPUS" -ge 2 ]; then
  # 2 GPUs: MLA latent vs full K/V all-gather and the MLA layer at CP = 1 / 2; the end-to-end CP
  # prefill of a 4-layer GQA stack against torch context_parallel.
  want mla && step mla 400 torchrun --nproc_per_node 2 benchmarks/run.py mla --out "$OUT/mla.json"
  want cp && step cp 560 torchrun --nproc_per_node 2 benchmarks/run.py cp --time-budget 400 --out "$OUT/cp.json"
else
  { want mla || want cp; } && note "mla, cp: skipped ($GPUS GPU; they need 2)"
fi
# The CP scaling model, from the measured cp rates when there are some.
if want scaling; then
  from=()
  [ -f "$OUT/cp.json" ] && from=(--from-json "$OUT/cp.json")
  bench scaling 120 scaling ${from[@]+"${from[@]}"} --png "$OUT/scaling-model.png" --json "$OUT/scaling-model.json"
fi
note "done; results in $OUT"
