#!/bin/bash
# Prefill MoE GEMM variants on one H100 (< 300 s): checks, then one K2 MoE layer at T=1K..16K for
# the current table and each variant; full output in $OUT/prefill_gemm.txt.
# Usage (repo root): bash benchmarks/prefill_device.sh [--variants a,b] [--ts 8192] [--routing uniform]
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # PYTHONPATH, OUT, unbuffered output
python3 -c "import triton; print('triton', triton.__version__)"
timeout 295 python3 benchmarks/prefill_device.py "$@"
