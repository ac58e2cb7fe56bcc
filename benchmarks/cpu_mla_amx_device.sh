#!/usr/bin/env bash
# Issue 33 items 2, 5: the native absorbed-MLA decode kernel (kernels/cpu/k2mla.h, AMX tiles) on
# the device host's CPU (the GPU stays idle), in < 150 s:
#   0. build: the CPU kernel (K2SERVE_CPU_KERNEL=native: a failed build fails here), its paths
#   1. correctness: the kernel against a float32 reference (every path, scattered pages, causal
#      verify steps), the flash-path tests, the bf16 fidelity harness on the tiny model
#   2. cpu_attn.py: checks, then MLA decode at 8K and 32K: kernel vs torch's flash kernel vs
#      the float32 einsums, with the read bandwidth and torch's bf16 matmul rate of the same run;
#      a 4-token verify step; projections at 1 row
#   3. cpu_e2e.py --full-k2 --experts 48 --context 8192: the full K2 extrapolated, MLA as the
#      engine runs it now (the kernel)
#   4. the same on 2 threads (OMP_NUM_THREADS=2: the kernel's pool, torch and the bandwidth
#      probe all on 2), the other thread count
#   5. the same as 3 with --mla ref (the float32 einsums: what a decode on scattered pages below
#      16K keys ran before), if the budget allows
# Each part has its own time limit and fails soft. Full outputs: $OUT/cpumla_*.txt.
#   bash benchmarks/cpu_mla_amx_device.sh
set -u
SECONDS=0
source benchmarks/device_env.sh  # OUT, PYTHONPATH (src, wheels from .whl if any)
PY=${PY:-python3}
BUDGET=${BUDGET:-145}  # seconds for all parts (the device command's limit is 150)
PREFIX=cpumla
source benchmarks/device_parts.sh  # run NAME SECONDS COMMAND...: budgeted parts, fail soft
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L3|amx" | cut -c1-160 >"$OUT/cpumla_host.txt" 2>&1
run build 30 env K2SERVE_CPU_KERNEL=native $PY -c "
from k2serve.kernels import cpu as ck
from k2serve.kernels.cpu import mla
lib = ck.load_kernel('native')
print('kernel built; AMX granted:', bool(lib.k2_amx_available()),
      '; MLA paths:', [mla.PATH_NAMES[p] for p in mla.mla_paths()])"
run tests 25 $PY -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_cpu_kernel.py \
  tests/kernels/test_mla_cpu_flash.py tests/integration/test_mla_cpu_flash_fidelity.py
run attn 35 $PY benchmarks/cpu_attn.py --rows 1 --copies 2 --prefill-queries 0
run e2e 34 $PY benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192
run e2e_2t 40 env OMP_NUM_THREADS=2 $PY benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192
run e2e_ref 34 $PY benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192 --mla ref
{
  echo "=== host"; cat "$OUT/cpumla_host.txt"
  echo "=== build"; tail -n 3 "$OUT/cpumla_build.txt"
  echo "=== tests"; tail -n 2 "$OUT/cpumla_tests.txt"
  echo "=== cpu_attn (MLA decode: kernel = the default path, flash, ref = float32 einsums)"
  grep -E "^# cpu_attn|^# decode path|^# check|^ +context|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+|^# verify|on pages" \
    "$OUT/cpumla_attn.txt" | cut -c1-200
  for p in e2e e2e_2t e2e_ref; do
    echo "=== cpu_e2e --full-k2 ($p)"
    grep -E "^# full K2|^# MLA" "$OUT/cpumla_$p.txt" | cut -c1-200
    sed -n '/^part/,/^EXTRAPOLATED full K2 decode/p' "$OUT/cpumla_$p.txt" | cut -c1-200
  done
  echo "=== parts"; cat "$OUT/cpumla_summary.txt"
} 2>&1 | tee "$OUT/cpumla_table.txt"
