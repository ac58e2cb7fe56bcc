#!/usr/bin/env bash
# Issue 33 item 2 (the absorbed kv_b, cpu_head_gemv, at the read-bandwidth limit) on the device
# host's CPU (the GPU stays idle), in < 90 s, parts fail soft:
#   0. checks: tests/moe/test_cpu_linear.py (cpu_head_gemv: the 16-row path's blocks and tails,
#      T = 1, 2; cpu_linear unchanged); builds the kernel
#   1. t16: benchmarks/cpu_head_gemv.py on 16 threads: the 16-row path (default: items of 64 KB
#      at 16 threads) vs the per-row path (-DK2_HEADS_LEGACY=1) vs whole-head items
#      (K2_HEADS_PER_THREAD=1: 128 KB) vs 32 KB items, each rep against its bandwidth probe
#   2. t2: the same on 2 threads (OMP_NUM_THREADS=2), fewer reps
# Full outputs: $OUT/kvb_*.txt; the table: $OUT/kvb_table.txt.
#   bash benchmarks/cpu_head_gemv_device.sh
set -u
SECONDS=0
source benchmarks/device_env.sh  # OUT, PYTHONPATH (src, wheels from .whl if any)
PY=${PY:-python3}
BUDGET=${BUDGET:-88}
PREFIX=kvb
source benchmarks/device_parts.sh  # run NAME SECONDS COMMAND...: budgeted parts, fail soft
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L3" | cut -c1-160 >"$OUT/kvb_host.txt" 2>&1
run checks 25 env K2SERVE_CPU_KERNEL=native $PY -m pytest -q -x -p no:cacheprovider \
  tests/moe/test_cpu_linear.py
run t16 35 $PY benchmarks/cpu_head_gemv.py --copies 80 --reps 5 \
  --define K2_HEADS_PER_THREAD=1 --define K2_HEADS_ITEM=32768
run t2 25 env OMP_NUM_THREADS=2 $PY benchmarks/cpu_head_gemv.py --copies 64 --reps 3
{
  echo "=== host"; cat "$OUT/kvb_host.txt"
  echo "=== checks"; tail -n 2 "$OUT/kvb_checks.txt"
  for p in t16 t2; do
    [ -f "$OUT/kvb_$p.txt" ] || continue
    echo "=== cpu_head_gemv.py ($p)"
    cut -c1-200 "$OUT/kvb_$p.txt" | tail -n 40
  done
  echo "=== parts"; cat "$OUT/kvb_summary.txt"
} 2>&1 | tee "$OUT/kvb_table.txt"
