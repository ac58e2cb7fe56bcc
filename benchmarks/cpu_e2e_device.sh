#!/usr/bin/env bash
# Issue 33 item 5 (target: CPU-only decode end to end with the full-model byte mix >= 65% of
# read bandwidth, on 2 threads and on 16): cpu_e2e.py --full-k2 on the device host's CPU (the
# GPU stays idle), in < 120 s, decode parts only (--decode-only):
#   0. checks: the CPU GEMV's pieced bf16 rounding (same values as one .to()), the CPU kernel
#      policy (fused q_a + kv_a, gate + up), the fused-projection logits test; kernel build;
#      omp_spin_probe.py: CPU the other threads burn after a parallel op / a wide GEMV output
#   1. e2e: --timing quiet (the new method: each part beside an idle torch OpenMP team,
#      checked; median of >= 7 calls; bandwidth probed per part, limit = the max) on 16 threads;
#      the shared expert three ways (3 GEMVs = before, fused gate_up = now, experts kernel)
#   2. e2e_legacy: --timing legacy (the previous method: best of 3 right after building the
#      weights, one bandwidth probe; shared expert as 3 GEMVs) on 16 threads
#   3. moe: cpu_moe.py's one-token MoE layer over the same 48 experts (16 threads): the e2e's
#      routed-experts part should agree with it (ms/layer = the e2e's ms/token / 60)
#   4. e2e_2t: as 1 on 2 threads (OMP_NUM_THREADS=2: the kernel's pool, torch, the probe)
#   5. e2e_2t_legacy: as 2 on 2 threads, if the budget allows
# Run in the order checks, 1, 2, 4, spin, 3, 5 (what matters most first); each part has its own
# time limit and fails soft. Full outputs: $OUT/e2e_*.txt.
#   bash benchmarks/cpu_e2e_device.sh
set -u
SECONDS=0
source benchmarks/device_env.sh  # OUT, PYTHONPATH (src, wheels from .whl if any)
PY=${PY:-python3}
BUDGET=${BUDGET:-117}  # seconds for all parts (the device command's limit is 120)
PREFIX=e2e
source benchmarks/device_parts.sh  # run NAME SECONDS COMMAND...: budgeted parts, fail soft
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L3|amx" | cut -c1-160 >"$OUT/e2e_host.txt" 2>&1
E2E="benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192 --decode-only"
run checks 22 env K2SERVE_CPU_KERNEL=native $PY -m pytest -q -x -p no:cacheprovider \
  tests/moe/test_cpu_linear.py tests/kernels/test_policy.py \
  tests/integration/test_backends.py -k "cpu_linear or cpu_head or policy or fused_projections"
run e2e 24 $PY $E2E
run e2e_legacy 16 $PY $E2E --timing legacy
run e2e_2t 30 env OMP_NUM_THREADS=2 $PY $E2E
run spin 13 $PY benchmarks/omp_spin_probe.py
run moe 16 $PY benchmarks/cpu_moe.py --experts 48 --batches 1 --prefill 0 --no-old --no-peer \
  --no-limit --no-forced --iters 15
run e2e_2t_legacy 25 env OMP_NUM_THREADS=2 $PY $E2E --timing legacy
{
  echo "=== host"; cat "$OUT/e2e_host.txt"
  echo "=== checks"; tail -n 2 "$OUT/e2e_checks.txt"
  echo "=== omp_spin_probe (torch team's spin after a parallel op; after a wide GEMV output)"
  grep -E "^T=|^GEMV" "$OUT/e2e_spin.txt" | cut -c1-200
  for p in e2e e2e_legacy e2e_2t e2e_2t_legacy; do
    [ -f "$OUT/e2e_$p.txt" ] || continue
    echo "=== cpu_e2e --full-k2 ($p)"
    grep -E "^# full K2|^# MLA|^# read bandwidth|^# shared expert as" "$OUT/e2e_$p.txt" | cut -c1-220
    sed -n '/^part/,/^EXTRAPOLATED full K2 decode/p' "$OUT/e2e_$p.txt" | cut -c1-220
    grep -E "Error|error" "$OUT/e2e_$p.txt" | tail -n 3 | cut -c1-220
  done
  echo "=== cpu_moe --experts 48, 1 token (16 threads): compare with the e2e routed row / 60"
  grep -E "read bandwidth|^ +tokens|^ +1 " "$OUT/e2e_moe.txt" | head -n 3 | cut -c1-200
  echo "=== parts"; cat "$OUT/e2e_summary.txt"
} 2>&1 | tee "$OUT/e2e_table.txt"
