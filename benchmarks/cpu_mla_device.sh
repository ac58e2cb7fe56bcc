#!/usr/bin/env bash
# Issue 33 item 2 (CPU MLA through torch's CPU flash kernel, attention/cpu_flash.py) on the
# device host's CPU (the GPU stays idle), in < 60 s:
#   0. correctness: the flash path against the float32 einsums, and through the fidelity
#      harness on the tiny bf16 model (tests)
#   1. cpu_attn.py: a flash-vs-float32 check, then MLA decode / 256-query prefill at 8K and 32K
#      context, flash path against the float32 einsums ('ref', the path before), projections at 1 row
# Full outputs: $OUT/mla_tests.txt, $OUT/mla_cpu_attn.txt; the table: $OUT/mla_table.txt.
#   bash benchmarks/cpu_mla_device.sh
set -u
OUT=${OUT:-/tmp/mla_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src}
PY=${PY:-python3}
timeout 15 $PY -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_cpu_flash.py \
  tests/kernels/test_mla_chunked.py tests/integration/test_mla_cpu_flash_fidelity.py \
  >"$OUT/mla_tests.txt" 2>&1
echo "## tests: rc $?" >"$OUT/mla_summary.txt"
timeout 40 $PY -u benchmarks/cpu_attn.py --rows 1 --copies 3 --prefill-queries 256 \
  >"$OUT/mla_cpu_attn.txt" 2>&1
echo "## cpu_attn: rc $?" >>"$OUT/mla_summary.txt"
{
  echo "=== host"; lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)"
  echo "=== tests"; tail -n 2 "$OUT/mla_tests.txt"
  echo "=== cpu_attn"; grep -v "^$" "$OUT/mla_cpu_attn.txt"
  cat "$OUT/mla_summary.txt"
} 2>&1 | tee "$OUT/mla_table.txt"
