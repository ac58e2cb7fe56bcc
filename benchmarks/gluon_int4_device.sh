#!/bin/bash
# The Gluon INT4 GEMM on one H100 (< 240 s): checks, then one K2 MoE layer's times; full output
# in $OUT/gluon_int4.txt. Usage (repo root): bash benchmarks/gluon_int4_device.sh [--ts 128,2048,8192,16384]
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # PYTHONPATH, OUT, unbuffered output
python3 -c "import triton; print('triton', triton.__version__)"
timeout 238 python3 benchmarks/gluon_int4_device.py "$@"
