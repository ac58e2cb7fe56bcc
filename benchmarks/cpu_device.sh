#!/usr/bin/env bash
# Issue 33 items 2, 3, 5 on the device host's CPU (the GPU stays idle), in < 180 s:
#   0. correctness: the CPU kernel tests of the new decode loop / per-head GEMV / MLA chunks
#   1. cpu_moe.py AFTER: the new loop, 1/4/16 tokens and a 2,048-token prompt (AMX path)
#   2. cpu_moe.py BEFORE: the previous INT4 x bf16 decode loop (K2_I4BF_LEGACY=1), 1/4/16 tokens
#   3. cpu_e2e.py --full-k2: the full K2 extrapolated from measured parts
#   4. cpu_attn.py: projections kernel vs torch at 1-16 rows, absorbed kv_b, MLA at 8K / 32K
# Each part has its own time limit and fails soft. Full outputs: $OUT/cpu_*.txt.
#   bash benchmarks/cpu_device.sh
set -u
SECONDS=0
OUT=${OUT:-/tmp/cpu_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src}
PY=${PY:-python3}
BUDGET=${BUDGET:-172}  # seconds for all parts (the device command's limit is 180)
PREFIX=cpu
source benchmarks/device_parts.sh  # run NAME SECONDS COMMAND...: budgeted parts, fail soft
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L3" >"$OUT/cpu_host.txt" 2>&1
run tests 33 $PY -m pytest -q -x -p no:cacheprovider tests/moe/test_cpu_int4_decode.py \
  tests/moe/test_cpu_linear.py tests/kernels/test_mla_chunked.py
run moe_after 45 $PY benchmarks/cpu_moe.py --no-old --no-peer --iters 8 --no-dot --no-forced
run moe_before 42 $PY benchmarks/cpu_moe.py --no-old --no-peer --prefill 0 --iters 8 \
  --define K2_I4BF_LEGACY=1
run e2e 36 $PY benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192
run attn 25 $PY benchmarks/cpu_attn.py --rows 1,2,4,8,16 --copies 3 --prefill-queries 256
{
  echo "=== host"; cat "$OUT/cpu_host.txt"
  echo "=== tests"; tail -n 2 "$OUT/cpu_tests.txt"
  for p in before after; do
    echo "=== cpu_moe $p (one K2 MoE layer, 384 INT4 experts)"
    grep -E "^# check|^# read bandwidth|^ +tokens|^ +[0-9]+ +[0-9.]+ +[0-9]+|matmul|limit for" \
      "$OUT/cpu_moe_$p.txt" | cut -c1-150
  done
  echo "=== cpu_attn"; grep -v "^$" "$OUT/cpu_attn.txt" | tail -n 14
  echo "=== cpu_e2e --full-k2"; tail -n 16 "$OUT/cpu_e2e.txt"
  echo "=== parts"; cat "$OUT/cpu_summary.txt"
} | tee "$OUT/cpu_table.txt"
