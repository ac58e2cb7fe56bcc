#!/bin/bash
# Issue 28, target "decode B=128 >= 60% of copy bandwidth": the tensor-core INT4 decode MoE,
# the f16 design (kernels/int4_moe_mma16.py, int4_moe_mma's only one), against the shipped
# decode paths on one K2 MoE layer (benchmarks/decode_mma.py: fp32-reference and per-pair
# checks, then CUDA-graph times, then the table), then the GPU tests at K2 sizes if the time
# allows. Under 240 s on one H100; everything it prints is in $OUT/mma_*.txt.
# Usage (repo root): OUT=/dir [ARGS="--tokens 128"] bash benchmarks/decode_mma.sh
cd "$(dirname "$0")/.." || exit 1
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TLIMIT:-205} python3 benchmarks/decode_mma.py --budget ${BUDGET:-170} ${ARGS:-} > "$OUT/mma_1.txt" 2>&1
echo "sweep rc=$? at ${SECONDS}s"
grep -E "^\||FAIL|Error|fp32-reference|launches|best|int4_decode_mma|copy bandwidth|total" "$OUT/mma_1.txt" | tail -n 70
left=$((232 - SECONDS))
if [ "$left" -gt 20 ]; then
  timeout "$left" python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels/test_int4_moe_mma16.py \
    > "$OUT/mma_gpu_tests.txt" 2>&1
  echo "gpu tests rc=$? at ${SECONDS}s"; tail -n 3 "$OUT/mma_gpu_tests.txt"
fi
