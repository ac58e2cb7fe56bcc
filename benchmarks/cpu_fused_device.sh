#!/usr/bin/env bash
# Issue 33 (target: CPU-only decode end to end with the full-model byte mix >= 65% of read
# bandwidth, on 2 threads and on 16): before/after of the routed + shared experts in ONE CPU
# kernel call at decode (k2_moe_forward_shared: one pool job per MoE layer instead of two) on
# the device host's CPU (the GPU stays idle), in < 300 s.
#   "after"  = cpu_e2e.py --full-k2 as the engine runs now (16 threads: one call per MoE layer)
#   "before" = the same with K2SERVE_CPU_FUSED_SHARED=0 (the routed experts' call, then the
#              shared expert's); every other part is the same code in both columns. At 2 threads
#              the engine runs the two parts either way (the shared expert is the module's
#              fused gate_up GEMV below moe.cpu_shared.KERNEL_MIN_THREADS): both columns alike.
# Every run also times the one call and the two calls side by side (cpu_moe_shared.py), with
# each kernel call's profile (wake / prologue / gate_up / down, us): the rows
# "routed+shared as one call / two calls" and the lines "routed + shared experts as ...".
#   0. build the kernel; checks: the fused call's tests (== the two calls in float32, torch
#      reference, experts not local, late worker, fallbacks, the model's MoE block), the greedy
#      test, the CPU experts / shared expert / INT4 decode / AMX tests
#   1. after / before / after / before on 16 threads, then after / before on 2 (OMP_NUM_THREADS=2:
#      the kernel's pool, torch and the probe), each part with its own limit, failing soft
# Full outputs: $OUT/fused_*.txt; the table: $OUT/fused_table.txt.
#   bash benchmarks/cpu_fused_device.sh
set -u
SECONDS=0
source benchmarks/device_env.sh  # OUT, PYTHONPATH (src, wheels from .whl if any)
PY=${PY:-python3}
BUDGET=${BUDGET:-285}  # seconds for all parts (the device command's limit is 300)
PREFIX=fused
source benchmarks/device_parts.sh  # run NAME SECONDS COMMAND...: budgeted parts, fail soft
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L2|L3" | cut -c1-160 >"$OUT/fused_host.txt" 2>&1
E2E="benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192 --also-context 1024 --decode-only"
run build 60 env K2SERVE_CPU_KERNEL=native $PY -c "
import torch
from k2serve.kernels import cpu as ck
from k2serve.moe.cpu_shared import use_kernel
lib = ck.load_kernel('native')
print('kernel built; torch', torch.__version__, torch.backends.cpu.get_cpu_capability(),
      '; k2_moe_forward_shared:', hasattr(lib, 'k2_moe_forward_shared'),
      '; shared expert on the kernel at', torch.get_num_threads(), 'threads:', use_kernel())"
run checks 90 $PY -m pytest -q -p no:cacheprovider \
  tests/moe/test_cpu_fused_shared.py tests/moe/test_cpu_shared.py tests/moe/test_cpu_experts.py \
  tests/moe/test_cpu_int4_decode.py tests/moe/test_cpu_amx.py \
  tests/model/test_parity.py::test_cpu_fused_shared_expert_decodes_the_float32_tokens \
  tests/model/test_parity.py::test_cpu_kernel_router_is_greedy_identical
run after 40 $PY $E2E
run before 40 env K2SERVE_CPU_FUSED_SHARED=0 $PY $E2E
run after_b 40 $PY $E2E
run before_b 40 env K2SERVE_CPU_FUSED_SHARED=0 $PY $E2E
run after_2t 45 env OMP_NUM_THREADS=2 $PY $E2E
run before_2t 45 env OMP_NUM_THREADS=2 K2SERVE_CPU_FUSED_SHARED=0 $PY $E2E
{
  echo "=== host"; cat "$OUT/fused_host.txt"
  echo "=== build"; tail -n 2 "$OUT/fused_build.txt" | cut -c1-200
  echo "=== checks"; tail -n 3 "$OUT/fused_checks.txt" | cut -c1-200
  echo "=== cpu_e2e --full-k2 (before = K2SERVE_CPU_FUSED_SHARED=0), ms/token and % of each run's max probe"
  $PY benchmarks/cpu_e2e_table.py 16t_after="$OUT/fused_after.txt" \
    16t_before="$OUT/fused_before.txt" 16t_after_b="$OUT/fused_after_b.txt" \
    16t_before_b="$OUT/fused_before_b.txt" 2t_after="$OUT/fused_after_2t.txt" \
    2t_before="$OUT/fused_before_2t.txt"
  echo "=== per MoE layer, one call vs two, with each call's profile (us: wake / prologue / gate_up / down)"
  for p in after before after_b before_b after_2t before_2t; do
    [ -f "$OUT/fused_$p.txt" ] || continue
    grep -E "^# routed \+ shared experts as (one|two)" "$OUT/fused_$p.txt" | sed "s/^# routed + shared experts as /$p: /" | cut -c1-330
    grep -E "Error|error" "$OUT/fused_$p.txt" | tail -n 3 | sed "s/^/$p: /" | cut -c1-220
  done
  echo "=== parts"; cat "$OUT/fused_summary.txt"
} 2>&1 | tee "$OUT/fused_table.txt"
