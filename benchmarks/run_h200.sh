#!/bin/bash
# One device call (issue 8): engine verification on CUDA, the speed run, then an ncu look at the
# decode GEMV with whatever time is left. Logs go to $OUT. Env: VERIFY=0 / PROBE=0 skip those
# steps; PARTS (model_speed.py parts); BUDGET (seconds for the whole script, default 570).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/k2out}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT"
left() { echo $((BUDGET - SECONDS - ${1:-0})); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
if [ "${VERIFY:-1}" = 1 ]; then
  echo "== pytest -q -m gpu tests/kernels tests/integration tests/engine tests/model -x"
  timeout 150 python3 -m pytest -q -m gpu tests/kernels tests/integration tests/engine \
    tests/model -x -p no:cacheprovider 2>&1 | tail -30
  echo "== pytest -q tests/kernels (every kernel test on CUDA)"
  timeout 120 python3 -m pytest -q tests/kernels -x -p no:cacheprovider 2>&1 | tail -8
  echo "(pytest done at ${SECONDS} s)"
  echo "== benchmarks/gpu_smoke.py"
  timeout 200 python3 benchmarks/gpu_smoke.py 2>&1 | grep -v "Loading weights"
  echo "(gpu_smoke rc=$? done at ${SECONDS} s)"
fi 2>&1 | tee "$OUT/verify.txt"
echo "== model_speed.py --parts ${PARTS:-ceil,check,model} (timeout $(left 40) s)"
timeout "$(left 40)" python3 benchmarks/model_speed.py --parts "${PARTS:-ceil,check,model}" \
  > "$OUT/bench.txt" 2>&1
echo "bench rc=$? at ${SECONDS} s"
grep -E "^ceilings|FAIL|Traceback|Error|tuned|^\| (gemv|model)|checks failed" "$OUT/bench.txt" \
  | tail -70
if [ "${SASS:-1}" = 1 ]; then  # the GEMV kernels' machine code, for instruction counts
  find ~/.triton/cache -name '_int4_gemv*.cubin' | head -6 | while read -r f; do
    cuobjdump --dump-sass "$f" > "$OUT/sass_$(basename "$f" .cubin)_$(basename "$(dirname "$f")" | cut -c1-6).txt"
  done
  ls "$OUT"
fi
if [ "${PROBE:-1}" = 1 ] && [ "$(left)" -gt 45 ]; then
  timeout "$(left 5)" ncu --clock-control none -k regex:_int4_gemv -c 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    python3 benchmarks/model_speed.py --parts probe > "$OUT/ncu.txt" 2>&1
  grep -E "_int4_gemv|Duration|DRAM Throughput|Registers Per|Achieved Occ|Theoretical Occ|Block Limit Reg|Warp Cycles Per Issued|Grid Size|Waves Per SM" \
    "$OUT/ncu.txt" | head -40
fi
