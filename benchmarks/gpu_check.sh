#!/bin/bash
# One device call: the GPU tests, the kernel tests on CUDA, then the model benchmark; logs in $OUT.
# Usage (from the repo root, wheels carried in .whl): bash benchmarks/gpu_check.sh [tests|speed|all]
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # wheels, PYTHONPATH, OUT
what=${1:-all}
run() {  # run SECONDS NAME CMD...: output to $OUT/NAME.txt, its tail printed
  local t=$1 name=$2; shift 2
  echo "== $name: $*"
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"
  grep -v "Loading weights" "$OUT/$name.txt" | tail -${TAIL:-14}
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = newtests ]; then
  echo "== pytest -m gpu"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors --ignore=tests/deploy \
    --ignore=tests/bench 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
  echo "== pytest tests/multimodal tests/engine/test_spec_decode_gpu.py tests/engine/test_kv_tier_gpu.py"
  timeout 200 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors tests/multimodal \
    tests/engine/test_spec_decode_gpu.py tests/engine/test_kv_tier_gpu.py 2>&1 \
    | tee "$OUT/pytest_features.txt" | tail -8
  [ "$what" = newtests ] || echo "== pytest tests/kernels tests/engine/test_profiling.py tests/engine/test_memory_agreement.py"
  [ "$what" = newtests ] || timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_profiling.py \
    tests/engine/test_memory_agreement.py 2>&1 | tee "$OUT/pytest_kernels.txt" | tail -6
fi
if [ "$what" = speed ] || [ "$what" = all ]; then
  echo "== model_speed.py --parts ceil,model --layers 3"
  timeout 200 python3 benchmarks/model_speed.py --parts ceil,model --layers 3 \
    > "$OUT/model_speed.txt" 2>&1
  grep -E "^ceilings|^\| model|FAIL|Traceback|Error" "$OUT/model_speed.txt" | tail -20
fi
if [ "$what" = features ]; then  # the new features' benchmarks (wave 4)
  TAIL=4 run 150 pytest_fixed python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_spec_decode_gpu.py tests/integration/test_piecewise_graphs.py
  run 150 vision_tower python3 benchmarks/vision_tower.py --images 1 8 32
  run 170 spec_verify python3 benchmarks/spec_decode_gpu.py --layers 3 --parts verify --iters 10
  run 150 kv_tier python3 benchmarks/kv_tier.py --device cuda --preset k2-slice --fmt int4 \
    --layers 3 --sessions 12 --context 16384 --turn 500 --output 32 --turns 2 --concurrency 4 \
    --pool-x 6 --batched-tokens 8192
  run 80 ep_dispatch python3 benchmarks/ep_dispatch.py --parts gpu --fmt int4 --tokens 1,16,64,256,1024
fi
