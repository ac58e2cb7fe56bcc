#!/bin/bash
# The warp-specialized FP8-block prompt GEMM on one H100 (< 200 s): the GPU tests first (WS
# against the shipped kernel, bit for bit; their summary line is printed), K2 layer checks at
# T=2048 / 8192, then one K2 FP8 MoE layer at T=8192 uniform and third, 16384, 4096: "table"
# (the shipped fp8_prefill_gluon configs) vs each WS config, % of the bf16 matmul rate.
# Output: $OUT/wsfp8_device.txt, wsfp8_pytest.txt, wsfp8_console.txt.
# Usage (repo root): bash benchmarks/wsfp8_device.sh [--variants a,b] [--ts 8192] [--skip-tests]
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # PYTHONPATH, OUT, unbuffered output
python3 -c "import triton; print('triton', triton.__version__)"
timeout 198 python3 benchmarks/wsfp8_device.py "$@" 2>&1 | tee "$OUT/wsfp8_console.txt"
