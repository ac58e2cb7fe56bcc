#!/usr/bin/env bash
# Issue 33 (target: CPU-only decode end to end with the full-model byte mix >= 65% of read
# bandwidth, on 2 threads and on 16): before/after of the one-call CPU decode router
# (kernels/cpu/k2router.h, kernels/cpu/router.py: the gate's GEMV and the noaux_tc top-k in one
# CPU kernel call, bit-identical to grouped_topk_torch) on the device host's CPU (the GPU stays
# idle), in < 300 s.
#   "after"  = cpu_e2e.py --full-k2 as the engine runs now (router part: TopkRouter's kernel call)
#   "before" = the same with --router-topk torch (the kernel's GEMV, then grouped_topk_torch's
#              torch ops: wave 7's router); every other part is the same code in both columns.
# The e2e's "MoE layer in the engine's order" line times router + routed experts with the three
# routers in every run (one call / wave 7's GEMV + torch top-k / wave 6's torch float32 GEMV).
#   0. build the kernel, print torch's CPU capability and the router's probe result (None would
#      mean the torch ops stay: then "after" = "before"); checks: the router tests (kernel vs
#      grouped_topk_torch bit for bit, the model's greedy tokens with and without the kernel
#      router), the GEMV tests
#   1. after / before / after / before on 16 threads, then after / before on 2 (OMP_NUM_THREADS=2:
#      the kernel's pool, torch and the probe), each part with its own limit, failing soft
# Full outputs: $OUT/router_*.txt; the table: $OUT/router_table.txt.
#   bash benchmarks/cpu_router_device.sh
set -u
SECONDS=0
source benchmarks/device_env.sh  # OUT, PYTHONPATH (src, wheels from .whl if any)
PY=${PY:-python3}
BUDGET=${BUDGET:-285}  # seconds for all parts (the device command's limit is 300)
PREFIX=router
source benchmarks/device_parts.sh  # run NAME SECONDS COMMAND...: budgeted parts, fail soft
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L2|L3" | cut -c1-160 >"$OUT/router_host.txt" 2>&1
E2E="benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192 --also-context 1024 --decode-only"
run build 60 env K2SERVE_CPU_KERNEL=native $PY -c "
import torch
from k2serve.kernels import cpu as ck
from k2serve.kernels.cpu import router as kr
ck.load_kernel('native')
print('kernel built; torch', torch.__version__, torch.backends.cpu.get_cpu_capability(),
      '; router (sigmoid chunk, sum vector) reproducing torch:', kr.torch_vector())"
run checks 90 env K2SERVE_CPU_KERNEL=native $PY -m pytest -q -p no:cacheprovider \
  tests/kernels/test_cpu_router.py tests/moe/test_router_robust.py tests/moe/test_cpu_linear.py \
  tests/model/test_parity.py::test_cpu_kernel_router_is_greedy_identical \
  tests/kernels/test_cpu_logits.py tests/engine/test_sampler.py
run after 40 $PY $E2E
run before 40 $PY $E2E --router-topk torch
run after_b 40 $PY $E2E
run before_b 40 $PY $E2E --router-topk torch
run after_2t 45 env OMP_NUM_THREADS=2 $PY $E2E
run before_2t 45 env OMP_NUM_THREADS=2 $PY $E2E --router-topk torch
# item 4: what the step end's ops over the 163,840 logits (compute_logits' .to(float32), the
# sampler's argmax) cost the next step's first kernel GEMVs: torch's (before) / the kernel's (now)
run sampler 30 $PY benchmarks/cpu_sampler_probe.py --iters 20 --gemvs 4
{
  echo "=== host"; cat "$OUT/router_host.txt"
  echo "=== build"; tail -n 2 "$OUT/router_build.txt" | cut -c1-200
  echo "=== checks"; tail -n 3 "$OUT/router_checks.txt" | cut -c1-200
  echo "=== cpu_e2e --full-k2 (before = --router-topk torch), ms/token and % of each run's max probe"
  $PY benchmarks/cpu_e2e_table.py 16t_after="$OUT/router_after.txt" \
    16t_before="$OUT/router_before.txt" 16t_after_b="$OUT/router_after_b.txt" \
    16t_before_b="$OUT/router_before_b.txt" 2t_after="$OUT/router_after_2t.txt" \
    2t_before="$OUT/router_before_2t.txt"
  for p in after before after_b before_b after_2t before_2t; do
    [ -f "$OUT/router_$p.txt" ] || continue
    grep -E "^# router timed as" "$OUT/router_$p.txt" | sed "s/^# /$p: /"
    grep -E "engine's order" "$OUT/router_$p.txt" | sed "s/^# MoE layer in the engine's order/$p: router+experts/" | cut -c1-330
    grep -E "Error|error" "$OUT/router_$p.txt" | tail -n 3 | sed "s/^/$p: /" | cut -c1-220
  done
  echo "=== sampler probe (16 threads): the next step's GEMVs after the step's end: torch's .to + argmax / the kernel's / the lm_head GEMV alone"
  tail -n 4 "$OUT/router_sampler.txt" | cut -c1-200
  echo "=== parts"; cat "$OUT/router_summary.txt"
} 2>&1 | tee "$OUT/router_table.txt"
