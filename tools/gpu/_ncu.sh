# Sourced by s15a.sh / s15b.sh / s19e.sh: ncu_dense OUT BACKENDS [BENCH_ARGS] profiles
# tools/gpu/ncu_dense.py's ranges (one call per workload of $NCU_WORKLOADS and backend; BENCH_ARGS:
# its --bench-args, the benchmark's workload options) into OUT.ncu-rep and prints the key metrics
# per kernel. NCU_EXTRA_METRICS (comma-separated) adds metrics to the sections' and to the
# printed table.
NCU_WORKLOADS="d128 S=16k zigzag C=1,d128 S=16k zigzag C=2,d192 S=16k zigzag C=1,d192 S=16k zigzag C=2"
NCU_METRICS=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,sm__cycles_active.avg
ncu_dense() {
  local out=$1 backends=$2 extra=()
  [ -n "${3:-}" ] && extra=(--bench-args "$3")  # else ncu_dense.py's default: the dense points
  timeout -s KILL 400 ncu --profile-from-start off --clock-control none --section SpeedOfLight \
    --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
    ${NCU_EXTRA_METRICS:+--metrics "$NCU_EXTRA_METRICS"} -o "$out" -f \
    python3 tools/gpu/ncu_dense.py --workloads "$NCU_WORKLOADS" --backends "$backends" \
      "${extra[@]}" > /tmp/ncu.log 2>&1
  echo "ncu rc $?"; grep -E "^profiled|skipped|Error|error" /tmp/ncu.log | head -20
  ncu --import "$out.ncu-rep" --page raw --csv --metrics "$NCU_METRICS${NCU_EXTRA_METRICS:+,$NCU_EXTRA_METRICS}" \
    > "$out.csv" 2>&1
  cut -c1-400 "$out.csv" | head -30
  # every collected metric, for reading back without ncu (raw names, and the sections' pages)
  ncu --import "$out.ncu-rep" --page raw --csv > "$out-raw.csv" 2>&1
  ncu --import "$out.ncu-rep" --page details --csv > "$out-details.csv" 2>&1
  ls -la "$out"*
}
