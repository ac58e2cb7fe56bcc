#!/bin/bash
# Per-device tuning run (issue 28; what wave 12 ran on the H200 and the H100 to build
# kernels/configs/h200.json over h100.json), each part against the shipped paths / tables in the
# same process, limits measured in the run, every candidate checked before it is timed:
#  1. the INT4 decode MoE (benchmarks/decode_mma.py: MMA_SWEEP or $MMA, at T = $TOKENS uniform
#     and T=128 on a third of the experts);
#  2. the Gluon GEMM's tiles at the middle sizes (wsgemm_device.py --part time at T = $MIDT,
#     uniform and third: the shipped table against the plain 32x256 and 64x256 tiles, wave 12's
#     entries there, which wave 13's warp-specialized 64-token tile replaced);
#  3. the warp-specialized prompt GEMM's variants (wsgemm_device.py, $WSV at T = $TS);
#  4. FP8 experts (fp8_moe.py --parts generic,band: the small-M generic kernel, the GEMMs and
#     the band's choice at T=128..1024).
# Everything printed is in $OUT/tune_*.txt. Under ~560 s on one H100 or H200.
# Usage (repo root): OUT=/dir [MMA=name,...] [WSV=name,...] bash benchmarks/tune_device.sh
cd "$(dirname "$0")/.." || exit 1
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 200 python3 benchmarks/decode_mma.py --budget ${MMA_BUDGET:-150} \
  --tokens "${TOKENS:-32,64,128,256}" --third 128 --configs "${MMA:-}" > "$OUT/tune_mma.txt" 2>&1
echo "1. decode sweep rc=$? at ${SECONDS}s"
grep -E "^\||FAIL|Error|copy bandwidth|best" "$OUT/tune_mma.txt" | tail -n 30
for T in ${MIDT:-256 512 768 1024}; do
  for r in uniform third; do
    timeout 60 python3 benchmarks/wsgemm_device.py --part time --T "$T" --routing "$r" \
      --variants 32x256s4w8hl,64x256s4w8hl >> "$OUT/tune_midt.txt" 2>&1
  done
done
echo "2. middle-size GEMM tiles at ${SECONDS}s"
grep -E "T=|ERROR" "$OUT/tune_midt.txt" | sed 's/ TFLOP.*//'
left=$((470 - SECONDS))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 benchmarks/wsgemm_device.py --skip-tests --budget $((left - 15)) \
    --variants "${WSV:-128x256s4w8hlgxxe2,128x256s4w8hlgx}" --ts "${TS:-8192,16384,4096}" \
    > "$OUT/tune_ws.txt" 2>&1
  echo "3. WS sweep rc=$? at ${SECONDS}s"
  grep -E "^\||FAIL|ERROR|matmul|checks" "$OUT/tune_ws.txt" | tail -n 20
fi
left=$((555 - SECONDS))
if [ "$left" -gt 40 ]; then
  timeout "$left" python3 benchmarks/fp8_moe.py --parts generic,band > "$OUT/tune_fp8.txt" 2>&1
  echo "4. FP8 rc=$? at ${SECONDS}s"
  grep -E "^\[.*\] \||fail" "$OUT/tune_fp8.txt" | tail -n 30
fi
