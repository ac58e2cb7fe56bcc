#!/bin/bash
# Nsight Compute counters of one K2 MoE layer's kernels (benchmarks/ncu_moe.py says which and
# why): DRAM / L2 / L1 throughput, issue activity, warp stall reasons. Issue 28.
# Usage (repo root, one GPU): OUT=$OUT bash benchmarks/ncu_moe.sh [case ...]
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # wheels, PYTHONPATH, OUT
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
  --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats"
METRICS="dram__bytes_read.sum,dram__bytes_read.sum.per_second,lts__t_bytes.sum,l1tex__t_bytes.sum,\
lts__t_sector_hit_rate.pct,sm__inst_executed.sum,smsp__inst_executed.avg.per_cycle_active,\
sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
# case: kernel-name regex, launches to skip (the warm-up's), launches to profile
declare -A KRE=([grouped128]=_int4_gemv_h2_grouped_kernel [pair32]=_int4_gemv_h2_kernel
                [gemm8k]=_int4_gemm_gluon_kernel [copy]=vectorized_elementwise)
declare -A SKIP=([grouped128]=4 [pair32]=4 [gemm8k]=4 [copy]=1)
cases=${*:-copy grouped128 pair32 gemm8k}
# STALLS=1: instead of the sections, why the warps did not issue (cycles per issued
# instruction by stall reason, hardware counters, no PC sampling)
if [ -n "$STALLS" ]; then
  SECTIONS=""
  METRICS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum"
fi
echo "ncu: $NCU"
for c in $cases; do
  echo "== $c"
  timeout 240 "$NCU" --clock-control none --target-processes all -k "regex:${KRE[$c]}" \
    --launch-skip "${SKIP[$c]}" --launch-count 2 $SECTIONS --metrics "$METRICS" \
    python3 benchmarks/ncu_moe.py --case "$c" > "$OUT/ncu_$c${STALLS:+_stalls}.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"
  grep -E "^ncu_moe|: path|==PROF==|Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|dram__bytes_read.sum |Executed Ipc A|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|error|Error" "$OUT/ncu_$c${STALLS:+_stalls}.txt" | head -60
  [ -n "$STALLS" ] && grep -E "stalled" "$OUT/ncu_${c}_stalls.txt" | sort -k3 -g -r | head -12
done
