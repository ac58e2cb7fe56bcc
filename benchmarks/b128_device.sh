#!/bin/bash
# Issue 28's decode B=128 target (branch w6-gpub128) in one device call of at most ~235 s on one
# H100: correctness first (the grouped GEMV variants' tests on the GPU: the word-pair PTX against
# exact math, every variant against the torch reference), then one K2 MoE layer at T=128, 64, 256,
# 192, 32 uniform and T=128 with the dummy router's skew: the shipped grouped GEMV and each
# variant (each checked against the per-pair GEMV's output before it is timed), the per-pair
# GEMV and the GEMM, % of the copy bandwidth of the same run, the two launches alone at T=128;
# then the k2-slice decode B=32 / B=128 (uniform routing) with the shipped table and the variant
# the layer run picks, as time allows. Every part fails soft; parts are cut by their time limits.
# Usage (repo root): bash benchmarks/b128_device.sh   -> $OUT/b128_*.txt, tables on stdout
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # wheels, PYTHONPATH, OUT
run() {  # run SECONDS NAME CMD...: output to $OUT/b128_NAME.txt
  local t=$1 name=$2; shift 2
  echo "== $name (limit ${t}s, at ${SECONDS}s): $*"
  timeout "$t" "$@" > "$OUT/b128_$name.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader

run 60 tests python3 -m pytest -q -p no:cacheprovider tests/kernels -k b128
tail -3 "$OUT/b128_tests.txt"
grep -E "^FAILED|^ERROR" "$OUT/b128_tests.txt" | head -8

# variants in order of interest: a part cut by its limit keeps the rows printed before
run 115 layer python3 benchmarks/b128_layer.py --budget 88 \
  --variants shipped,X2_S3_W32_P4,X2_S4_W32_P4_BN8,X2_S3,X2_S4_W32,X2_S3_W32,S3_W32_P4,X2_S4_W32_P4,X2_S4_W32_P4_R128,S3,X2_S3_BN8,X2_S3_R168,X2_S3_P4,X2_S3_w2P4,X2,S2
grep -E "^\| |^ceilings|^pick|^for configs|FAIL|Traceback|Error|not timed|checks failed" \
  "$OUT/b128_layer.txt" | grep -v "^| part\|^| b128 \|^| b128-split" | tail -24
echo "== split: the two launches alone (ms, GB/s, % copy bw)"
grep -E "^\| b128-split|registers" "$OUT/b128_layer.txt" | cut -d'|' -f3-6

# the model: shipped, then the variant the layer run picked (none if it kept shipped)
pick=$(grep "^pick: " "$OUT/b128_layer.txt" | awk '$2 != "shipped" && $2 != "none" {print $2}')
left=$((232 - SECONDS))
if [ "$left" -ge 30 ]; then
  run "$left" model python3 benchmarks/model_speed.py --parts ceil,model --layers 3 \
    --routing uniform --quick --batches 32,128 --prefills "" --grouped-variants "$pick"
  grep -E "^ceilings|^\| model|FAIL|Traceback|Error" "$OUT/b128_model.txt" | tail -10
else
  echo "== model: skipped (${left}s left)"
fi
echo "== done at ${SECONDS}s"
