#!/usr/bin/env bash
# Issue 33 (target: CPU-only decode end to end with the full-model byte mix >= 65% of read
# bandwidth, on 2 threads and on 16): before/after of the wave-7 e2e changes on the device host's
# CPU (the GPU stays idle), in < 300 s. "before" = the CPU kernel built with
# -DK2_BFBF_PF_LEGACY=1 (the bf16 GEMV's previous prefetch and 32-row items: attention
# projections, shared expert, dense MLP, lm_head); "after" = the default build. (Not switchable,
# so in both columns: the MLA forward's Python trim, the router's logits on the CPU kernel (the
# e2e's "MoE layer in the engine's order" line times router + experts with the router both
# ways: before = torch's float32 GEMV, which left torch's OpenMP team spinning beside the
# experts call), and the shared expert's rule, moe.cpu_shared: from 8 pool threads one
# experts-kernel call, else the fused gate_up; the e2e prints which it timed and all three
# ways, "shared as ...".)
#   0. build both kernel variants (so no part times a compile); checks: the GEMV / head GEMV /
#      MLA kernel / policy / fused-projection tests
#   1. cpu_e2e.py --full-k2 --experts 48 --context 8192 --decode-only (quiet timing: each part
#      beside an idle torch OpenMP team, median of >= 7, bandwidth probed per part, limit = the
#      max probe; the MLA also at 1K context: a second decode figure), after and before, on 16
#      threads, then on 2 (OMP_NUM_THREADS=2: the kernel's pool, torch and the probe), alternated
#   2. cpu_mla_e2e.py: one layer's MLA decode at 1K and 8K as the kernel alone on one hot cache
#      (what cpu_attn's 0.484 ms measured), over 16 caches (what the e2e part reads), through
#      TorchMLABackend.forward, and with the cache and the kernel's buffers cold (as in the
#      engine: ~500 MB of weights pass between two layers' MLA), on 16 and 2 threads
#   3. a second after/before pair on 16 threads, then the new prefetch with 32-row items
#      (-DK2_LINEAR_PER_THREAD=1: which of the two GEMV changes did it), if the budget allows
# Each part has its own time limit and fails soft. Full outputs: $OUT/e2e_*.txt; the table:
# $OUT/e2e_table.txt.
#   bash benchmarks/cpu_e2e_device.sh
set -u
SECONDS=0
source benchmarks/device_env.sh  # OUT, PYTHONPATH (src, wheels from .whl if any)
PY=${PY:-python3}
BUDGET=${BUDGET:-290}  # seconds for all parts (the device command's limit is 300)
PREFIX=e2e
source benchmarks/device_parts.sh  # run NAME SECONDS COMMAND...: budgeted parts, fail soft
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L2|L3|amx" | cut -c1-160 >"$OUT/e2e_host.txt" 2>&1
BEFORE=K2_BFBF_PF_LEGACY=1
E2E="benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192 --also-context 1024 --decode-only"
run build 60 env K2SERVE_CPU_KERNEL=native $PY -c "
from k2serve.kernels import cpu as ck
from k2serve.kernels.cpu import mla
lib = ck.load_kernel('native')
print('kernel built; AMX granted:', bool(lib.k2_amx_available()), '; MLA paths:',
      [mla.PATH_NAMES[p] for p in mla.mla_paths()])
from pathlib import Path
import os
flags = ck.CXX_FLAGS
base = Path(os.environ.get('K2SERVE_CACHE_DIR') or Path.home() / '.cache' / 'k2serve')
for d in ('$BEFORE', 'K2_LINEAR_PER_THREAD=1'):
    ck.CXX_FLAGS = flags + ('-D' + d,)
    print(d, 'variant built:', ck._build(base / 'cpu_kernel'))"
run checks 30 env K2SERVE_CPU_KERNEL=native $PY -m pytest -q -x -p no:cacheprovider \
  tests/moe/test_cpu_linear.py tests/moe/test_cpu_shared.py tests/kernels/test_mla_cpu_kernel.py \
  tests/kernels/test_policy.py tests/integration/test_backends.py \
  -k "cpu_linear or cpu_head or cpu_shared or mla or policy or fused_projections"
run after 35 $PY $E2E
run before 35 $PY $E2E --define $BEFORE
run after_2t 45 env OMP_NUM_THREADS=2 $PY $E2E
run before_2t 45 env OMP_NUM_THREADS=2 $PY $E2E --define $BEFORE
run mla 20 $PY benchmarks/cpu_mla_e2e.py --contexts 1024,8192
run mla_2t 25 env OMP_NUM_THREADS=2 $PY benchmarks/cpu_mla_e2e.py --contexts 1024,8192 --reps 7
run after_b 35 $PY $E2E
run before_b 35 $PY $E2E --define $BEFORE
run items32 30 $PY $E2E --define K2_LINEAR_PER_THREAD=1  # the new prefetch, 32-row items
{
  echo "=== host"; cat "$OUT/e2e_host.txt"
  echo "=== build"; tail -n 3 "$OUT/e2e_build.txt" | cut -c1-200
  echo "=== checks"; tail -n 2 "$OUT/e2e_checks.txt"
  echo "=== cpu_e2e --full-k2 (before = -D$BEFORE), ms/token and % of each run's max probe"
  $PY benchmarks/cpu_e2e_table.py 16t_before="$OUT/e2e_before.txt" 16t_after="$OUT/e2e_after.txt" \
    16t_before_b="$OUT/e2e_before_b.txt" 16t_after_b="$OUT/e2e_after_b.txt" \
    2t_before="$OUT/e2e_before_2t.txt" 2t_after="$OUT/e2e_after_2t.txt" \
    16t_items32="$OUT/e2e_items32.txt"
  for p in after before after_2t before_2t after_b before_b items32; do
    [ -f "$OUT/e2e_$p.txt" ] || continue
    grep -E "engine's order" "$OUT/e2e_$p.txt" | sed "s/^# MoE layer in the engine's order/$p: router+experts/" | cut -c1-260
    grep -E "Error|error" "$OUT/e2e_$p.txt" | tail -n 3 | sed "s/^/$p: /" | cut -c1-220
  done
  for p in mla mla_2t; do
    echo "=== cpu_mla_e2e ($p): one layer's MLA decode, kernel alone vs the e2e's read vs forward vs cold"
    grep -vE "^\s*$" "$OUT/e2e_$p.txt" | tail -n 14 | cut -c1-200
  done
  echo "=== parts"; cat "$OUT/e2e_summary.txt"
} 2>&1 | tee "$OUT/e2e_table.txt"
