#!/bin/bash
# Issue 28 items 1, 3, 4, 6 (branch w5-dispatch) in one device call of at most ~290 s on one GPU:
# correctness first (the new kernels' tests), then the warm-up on a cold Triton cache, the MoE
# dispatch / library comparison, and the k2-slice model figures for the dummy and uniform routing.
# Usage (repo root): bash benchmarks/w5_dispatch.sh   -> $OUT/dispatch_*.txt, tables on stdout
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # wheels, PYTHONPATH, OUT
# a fresh cache: the warm-up part measures what a first start-up compiles; later parts reuse it
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/w5_dispatch_triton}
run() {  # run SECONDS NAME CMD...: output to $OUT/dispatch_NAME.txt
  local t=$1 name=$2; shift 2
  echo "== $name (limit ${t}s): $*"
  timeout "$t" "$@" > "$OUT/dispatch_$name.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"
}
table() {  # the markdown rows and the failed checks of a part's output
  grep -E "^\| |^ceilings|^fp8 matmul|checks failed|FAIL|Traceback|Error|chose|fastest|flashinfer|warm-up" \
    "$OUT/dispatch_$1.txt" | grep -v "^| part" | tail -"${2:-60}"
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch; print('scaled_grouped_mm:', hasattr(torch, '_scaled_grouped_mm'), 'grouped_mm:', hasattr(torch, '_grouped_mm'))"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1

run 40 tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_select.py \
  tests/engine/test_warmup.py
tail -3 "$OUT/dispatch_tests.txt"
run 55 warmup python3 benchmarks/model_speed.py --parts warmup --layers 3
table warmup 12
run 95 moe_libs python3 benchmarks/moe_libs.py --parts dispatch,libs \
  --dispatch-tokens 16,32,64,128,192,256 --lib-tokens 1,16,128,1024,4096,16384
table moe_libs 90
run 100 model python3 benchmarks/model_speed.py --parts ceil,model,peer --layers 3 \
  --routing dummy,uniform --quick
table model 40
echo "== done at ${SECONDS}s"
