#!/usr/bin/env bash
# Issue 33 item 3 (the CPU experts' decode step at 1 / 4 / 5 / 6 / 16 tokens) on the device
# host's CPU (the GPU stays idle), in < 150 s:
#   0. omp_spin_probe.py: CPU time torch's OpenMP threads spend after one op on [T, 7168]
#      (the float32 -> bf16 conversion the backend ran after each call) at T = 4 / 5 / 16
#   0. correctness: the CPU kernel tests (decode loop vs its float32 reference at T = 1..9, 17;
#      a late pool thread, uneven node splits, the bf16 output; experts, AMX)
#   1. cpu_experts_ab.py: before (-DK2_SYNC_BARRIERS=1 + torch's float32 -> bf16 conversion)
#      vs after in one process, same weights and routing, inputs ready / a torch op before each
#      call, and the T = 1..8 verify table; read bandwidth in the same run
#   2. cpu_moe.py (after): the usual table at 1, 4, 5, 6, 16 tokens with its own bandwidth probe
# Each part has its own time limit and fails soft. Full outputs: $OUT/cpuexp_*.txt.
#   bash benchmarks/cpu_experts_device.sh
set -u
SECONDS=0
OUT=${OUT:-/tmp/cpuexp_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src}
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
BUDGET=${BUDGET:-145}  # seconds for all parts (the device command's limit is 150)
PREFIX=cpuexp
source benchmarks/device_parts.sh  # run NAME SECONDS COMMAND...: budgeted parts, fail soft
{
  lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|NUMA node\(s\)|L3"
  echo "load: $(cat /proc/loadavg)"
} >"$OUT/cpuexp_host.txt" 2>&1
run spin 12 $PY benchmarks/omp_spin_probe.py
run tests 40 $PY -m pytest -q -x -p no:cacheprovider tests/moe/test_cpu_int4_decode.py \
  tests/moe/test_cpu_experts.py tests/moe/test_cpu_amx.py
run ab 70 $PY benchmarks/cpu_experts_ab.py --iters 8 --batches 1,4,5,6,16 --verify 1,2,3,4,5,6,7,8
run moe 40 $PY benchmarks/cpu_moe.py --no-old --no-peer --prefill 0 --iters 8 \
  --batches 1,4,5,6,16
{
  echo "=== host"; cat "$OUT/cpuexp_host.txt"
  echo "=== torch's OpenMP threads after one op (omp_spin_probe.py)"; cat "$OUT/cpuexp_spin.txt"
  echo "=== tests"; tail -n 2 "$OUT/cpuexp_tests.txt"
  echo "=== before / after (cpu_experts_ab.py)"
  grep -E "^# (check|read bandwidth|cpu_experts_ab)|^\|" "$OUT/cpuexp_ab.txt" | cut -c1-170
  echo "=== cpu_moe.py (after)"
  grep -E "^# check|^# read bandwidth|^# timed|^ +tokens|^ +[0-9]+ +[0-9.]+ +[0-9]+|^# +[0-9]+ +[0-9.]+ " \
    "$OUT/cpuexp_moe.txt" | cut -c1-150
  echo "=== parts"; cat "$OUT/cpuexp_summary.txt"
} | tee "$OUT/cpuexp_table.txt"
