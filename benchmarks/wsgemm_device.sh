#!/bin/bash
# The warp-specialized INT4 prompt GEMM on one H100 (< 200 s): the GPU tests first (WS against
# the shipped kernel, bit for bit; their summary line is printed), K2 layer checks at T=2048 /
# 8192, then one K2 MoE layer at T=8192 uniform and third, 16384, 4096, 2048: "before" (the
# shipped configs without WS) vs "table" (h100.json's, WS from 32768 pairs) and the WS configs,
# % of the bf16 matmul rate. Output: $OUT/wsgemm_device.txt, wsgemm_pytest.txt, wsgemm_console.txt.
# Usage (repo root): bash benchmarks/wsgemm_device.sh [--variants a,b] [--ts 8192] [--skip-tests]
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # PYTHONPATH, OUT, unbuffered output
python3 -c "import triton; print('triton', triton.__version__)"
timeout 198 python3 benchmarks/wsgemm_device.py "$@" 2>&1 | tee "$OUT/wsgemm_console.txt"
