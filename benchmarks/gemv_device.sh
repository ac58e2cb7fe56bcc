#!/usr/bin/env bash
# Grouped INT4 decode GEMV variants on one GPU (benchmarks/gemv_device.py): checks, then times.
# Run from the repo root: OUT=/dir bash benchmarks/gemv_device.sh   (< 240 s on an H100)
set -u
OUT=${OUT:-/tmp/gemv_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src}
timeout 235 python3 benchmarks/gemv_device.py --budget 190 "$@" 2>&1 | tee "$OUT/gemv_device_log.txt"
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/gemv_device_log.txt"
