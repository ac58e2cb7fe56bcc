#!/bin/bash
# Issue 26 (speculative decoding) on one H100 in under 240 s; logs in $OUT/spec_*.txt.
# e2e decode at controlled acceptance (after its checks: the calibrated peaked model follows its
# successor chain, greedy output equals speculation off), the verify step against its bandwidth
# floor and the MoE kernel path of a 2..6-token step, then greedy identity on the peaked
# k2-slice in bf16 for every drafter (pytest) with the time left; SPEC_EXTRA=1 adds item 5
# and the draft heads (over 240 s).
# Usage (from the repo root, wheels carried in .whl): bash benchmarks/spec_gpu_check.sh
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # wheels, PYTHONPATH, OUT
run() {  # run SECONDS NAME CMD...: output to $OUT/NAME.txt
  local t=$1 name=$2; shift 2
  echo "== $name: $*"
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
# SPEC_EXTRA=1: also item 5 (verify cost with the experts on the CPU, beside the GPU runs) and
# the EAGLE-3 draft heads at K2.5 sizes (both measured on 2026-11-24; they do not fit in 240 s
# with the rest)
if [ "${SPEC_EXTRA:-0}" = 1 ]; then
  timeout 110 python3 benchmarks/cpu_moe.py --experts 384 --threads 12 --spec-verify 0,0.5 \
    --iters 5 --bw-gib 2 --no-peer > "$OUT/spec_cpu_verify.txt" 2>&1 &
fi
# e2e first: it checks (the peaked model follows its chain, speculative output equals
# speculation off) before it times; then the verify step's cost; the drafters' greedy identity
# tests with what is left
run 90 spec_e2e python3 benchmarks/spec_decode_gpu.py --layers 3 --parts e2e --ctx 512 \
  --out-tokens 96 --reps 3
run 65 spec_verify python3 benchmarks/spec_decode_gpu.py --layers 3 --parts verify,moe \
  --batches 1,8 --iters 10
wait
left=$((232 - SECONDS))
if [ "$left" -gt 20 ]; then
  run "$left" spec_pytest python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_spec_decode_gpu.py -k peaked
else
  echo "== spec_pytest: skipped (${SECONDS}s used)" > "$OUT/spec_pytest.txt"
fi
parts="spec_e2e spec_verify spec_pytest"
if [ "${SPEC_EXTRA:-0}" = 1 ]; then
  run 120 spec_draft python3 benchmarks/spec_decode_gpu.py --layers 3 --parts draft \
    --ctx 512 --iters 10 --e2e-batches 1,16
  parts="spec_cpu_verify $parts spec_draft"
fi
for f in $parts; do
  echo "== $f"
  grep -E "^\||^#|^##|^\(|FAIL|PASS|Error|error|passed|failed" "$OUT/$f.txt" | grep -v "^|---" \
    | tail -40
done
