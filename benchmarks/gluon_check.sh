#!/bin/bash
# The Gluon INT4 GEMM as the engine's default (issue 28) on one H100/H200, in one device call
# (< 600 s): the GPU tests of the kernels and the warm-up, the model benchmark with the Gluon
# kernel and with K2SERVE_INT4_GEMM=triton (before / after in the same run), then the warm-up
# part (first steps of new shapes after engine.warmup). Logs in $OUT/gc_*.txt.
# Usage (repo root): OUT=/some/dir bash benchmarks/gluon_check.sh
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # run SECONDS NAME CMD...
  local t=$1 name=$2; shift 2
  echo "== $name: $*"
  timeout "$t" "$@" > "$OUT/gc_$name.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"
}
run 170 tests python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_warmup.py
tail -4 "$OUT/gc_tests.txt"
for b in gluon triton; do
  K2SERVE_INT4_GEMM=$b run 150 "model_$b" python3 benchmarks/model_speed.py --parts ceil,model \
    --layers 3 --routing dummy,uniform --quick
  grep -E "^ceilings|^\| model|FAIL|Traceback|Error" "$OUT/gc_model_$b.txt" | tail -16
done
run 110 warmup python3 benchmarks/model_speed.py --parts warmup --layers 3
grep -E "^\| warmup|Traceback|Error" "$OUT/gc_warmup.txt" | cut -c1-220
