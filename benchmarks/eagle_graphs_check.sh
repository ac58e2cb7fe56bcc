#!/bin/bash
# w5-eagle's device call (<= 120 s, one H100): (1) the Llama head's decode kernel and the
# float32 CUDA test of the EAGLE-3 draft graphs (graph drafts == eager drafts step by step,
# acceptance identical, greedy == speculation off), (2) the draft step with / without its graphs
# (k2-slice 3 layers, K2.5 sizes), (3) the peaked bf16 k2-slice eagle3 tests (greedy ==
# speculation off, draft graphs replayed) in the time left.
# Usage (from the repo root): bash benchmarks/eagle_graphs_check.sh ; full logs in $OUT/eagle_*.txt
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # wheels, PYTHONPATH, OUT
echo "== pytest: gqa_decode kernel, draft graphs float32 (graph == eager)"
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gqa_decode.py \
  tests/engine/test_spec_decode_gpu.py -k "gqa_decode or draft_graphs" 2>&1 \
  | tee "$OUT/eagle_pytest.txt" | tail -6
echo "(pytest rc=$? at ${SECONDS}s)"
echo "== draft step timing"
timeout 55 python3 benchmarks/eagle_graphs_gpu.py --layers 3 --batches 1,8 --iters 10 \
  > "$OUT/eagle_draft_bench.txt" 2>&1
echo "(bench rc=$? at ${SECONDS}s)"
grep -E "^\||^#|FAIL|Error" "$OUT/eagle_draft_bench.txt" | grep -v "Random weights"
left=$((117 - SECONDS))
echo "== pytest: peaked bf16 k2-slice eagle3 (${left}s left)"
if [ "$left" -ge 10 ]; then
  timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec_decode_gpu.py \
    -k "peaked and eagle3" 2>&1 | tee "$OUT/eagle_pytest_peaked.txt" | tail -4
  echo "(peaked rc=$? at ${SECONDS}s)"
else
  echo "(peaked: skipped, no time left)"
fi
