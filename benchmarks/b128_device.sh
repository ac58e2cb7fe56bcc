#!/bin/bash
# Issue 28's decode B=128 target (branch w6-gpub128) in one device call of at most ~235 s on one
# H100: correctness first (the grouped GEMV variants' tests on the GPU: the inline PTX and the
# pipelined loops compile and equal the reference), then one K2 MoE layer at T=32..256 uniform
# and the dummy router's skew for the shipped grouped GEMV and each variant (two processes: the
# pipelined-only variants, then the word-pair ones, each with its own shipped baseline, so a
# compiler failure in one family leaves the other's figures), then the k2-slice decode B=32 /
# B=128 with the two variants the layer run picks, as time allows. Every part fails soft.
# Usage (repo root): bash benchmarks/b128_device.sh   -> $OUT/b128_*.txt, tables on stdout
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # wheels, PYTHONPATH, OUT
export PYTHONPATH=$PYTHONPATH:benchmarks
run() {  # run SECONDS NAME CMD...: output to $OUT/b128_NAME.txt
  local t=$1 name=$2; shift 2
  echo "== $name (limit ${t}s, at ${SECONDS}s): $*"
  timeout "$t" "$@" > "$OUT/b128_$name.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader

run 55 tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_int4_grouped_b128.py
tail -4 "$OUT/b128_tests.txt"
grep -E "^FAILED|Error" "$OUT/b128_tests.txt" | head -8

run 75 layer_pipelined python3 benchmarks/b128_layer.py --variants shipped,S3,S3_P4,S2,S4,F16SUM_S3
grep -E "^\| |^ceilings|^pick|^for configs|FAIL|Traceback|Error|not timed|checks failed" \
  "$OUT/b128_layer_pipelined.txt" | grep -v "^| part\|^| b128" | tail -20
run 85 layer_x2 python3 benchmarks/b128_layer.py --no-refs \
  --variants shipped,X2_S3,X2_S3_P4,X2_S3_w2P4,X2,X2_S3_M8,X2_S3_w2N32
grep -E "^\| |^ceilings|^pick|^for configs|FAIL|Traceback|Error|not timed|checks failed" \
  "$OUT/b128_layer_x2.txt" | grep -v "^| part\|^| b128" | tail -20
echo "== split (T=128: gate+up / down launches alone)"
grep -h "^| b128-split" "$OUT"/b128_layer_*.txt | cut -d'|' -f3-6

# the model: the variants the two layer runs picked (the same as shipped: none)
picks=$(grep -h "^pick: " "$OUT"/b128_layer_*.txt | awk '$2 != "shipped" && $2 != "none" {print $2}' \
  | paste -sd, -)
left=$((232 - SECONDS))
if [ "$left" -ge 35 ]; then
  run "$left" model python3 benchmarks/model_speed.py --parts ceil,model --layers 3 \
    --routing uniform --quick --batches 32,128 --prefills "" --grouped-variants "$picks"
  grep -E "^ceilings|^\| model|FAIL|Traceback|Error" "$OUT/b128_model.txt" | tail -12
else
  echo "== model: skipped (${left}s left)"
fi
echo "== done at ${SECONDS}s"
