#!/bin/bash
# One device call: the GPU tests, the kernel tests on CUDA, then the model benchmark; logs in $OUT.
# Usage (from the repo root, wheels carried in .whl): bash benchmarks/gpu_check.sh [tests|speed|all]
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
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "== pytest -m gpu"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -x --ignore=tests/deploy --ignore=tests/bench 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
  echo "== pytest tests/kernels tests/engine/test_profiling.py tests/engine/test_memory_agreement.py"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_profiling.py \
    tests/engine/test_memory_agreement.py 2>&1 | tee "$OUT/pytest_kernels.txt" | tail -6
fi
if [ "$what" = speed ] || [ "$what" = all ]; then
  echo "== model_speed.py --parts ceil,model --layers 3"
  timeout 200 python3 benchmarks/model_speed.py --parts ceil,model --layers 3 \
    > "$OUT/model_speed.txt" 2>&1
  grep -E "^ceilings|^\| model|FAIL|Traceback|Error" "$OUT/model_speed.txt" | tail -20
fi
