#!/bin/bash
# Per-device tuning run (issue 28: the tables were tuned on the H100 and used unchanged on the
# H200): the INT4 decode MoE sweep (benchmarks/decode_mma.py, every config of MMA_SWEEP or
# MMA, at T = TOKENS uniform and T=128 on a third of the experts) and the warp-specialized INT4
# prompt GEMM's variants (benchmarks/wsgemm_device.py, WS variants at T = TS, uniform + third),
# each against the shipped paths / table in the same process, limits measured in the run.
# Everything printed is in $OUT/tune_*.txt. Under ~560 s on one H100 or H200.
# Usage (repo root): OUT=/dir [MMA=name,...] [WSV=name,...] bash benchmarks/tune_device.sh
cd "$(dirname "$0")/.." || exit 1
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 250 python3 benchmarks/decode_mma.py --budget ${MMA_BUDGET:-200} \
  --tokens "${TOKENS:-32,64,128,256}" --third 128 --configs "${MMA:-}" > "$OUT/tune_mma.txt" 2>&1
echo "decode sweep rc=$? at ${SECONDS}s"
grep -E "^\||FAIL|Error|copy bandwidth|best|experts hit" "$OUT/tune_mma.txt" | tail -n 45
left=$((545 - SECONDS))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 benchmarks/wsgemm_device.py --skip-tests --budget $((left - 15)) \
    --variants "${WSV:-128x256s4w8hlgxxe2,256x128s3w8hlxxe2,256x128s3w8hlxx}" \
    --ts "${TS:-8192,16384,4096}" > "$OUT/tune_ws.txt" 2>&1
  echo "WS sweep rc=$? at ${SECONDS}s"
  grep -E "^\||FAIL|ERROR|matmul|checks" "$OUT/tune_ws.txt" | tail -n 30
fi
