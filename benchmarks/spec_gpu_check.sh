#!/bin/bash
# Issue 26 (speculative decoding) on one H100 in under 240 s; logs in $OUT/spec_*.txt.
# Check first (greedy identity on the peaked k2-slice in bf16 for every drafter), then time (the
# verify step against its bandwidth floor, the MoE kernel path of a 2..6-token step, e2e decode
# at controlled acceptance), while the CPU runs item 5 (verify cost with the experts on the CPU).
# Usage (from the repo root, wheels carried in .whl): bash benchmarks/spec_gpu_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/k2out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:src
else
  export PYTHONPATH=src
fi
run() {  # run SECONDS NAME CMD...: output to $OUT/NAME.txt
  local t=$1 name=$2; shift 2
  echo "== $name: $*"
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
# item 5 on 12 of the 16 cores, beside the (untimed) correctness tests
timeout 110 python3 benchmarks/cpu_moe.py --experts 384 --threads 12 --spec-verify 0,0.5 \
  --iters 5 --bw-gib 2 --no-peer > "$OUT/spec_cpu_verify.txt" 2>&1 &
cpu_pid=$!
run 85 spec_pytest python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec_decode_gpu.py \
  -k peaked
tail -4 "$OUT/spec_pytest.txt"
wait "$cpu_pid"
echo "(cpu_moe rc=$? at ${SECONDS}s)"
run 65 spec_verify python3 benchmarks/spec_decode_gpu.py --layers 3 --parts verify,moe \
  --batches 1,8 --iters 10
run 60 spec_e2e python3 benchmarks/spec_decode_gpu.py --layers 3 --parts e2e --ctx 512 \
  --out-tokens 96
left=$((232 - SECONDS))  # the draft heads at K2.5 sizes with what is left of the 240 s
if [ "$left" -gt 30 ]; then
  run "$left" spec_draft python3 benchmarks/spec_decode_gpu.py --layers 3 --parts draft \
    --ctx 512 --iters 10 --e2e-batches 1,16
else
  echo "== spec_draft: skipped (${SECONDS}s used)" > "$OUT/spec_draft.txt"
fi
for f in spec_cpu_verify spec_verify spec_e2e spec_draft; do
  echo "== $f"
  grep -E "^\||^#|^##|^\(|FAIL|Error|error" "$OUT/$f.txt" | grep -v "^|---" | tail -40
done
