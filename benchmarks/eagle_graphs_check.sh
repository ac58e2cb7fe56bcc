#!/bin/bash
# w5-eagle's device call (<= 120 s, one H100): (1) the Llama head's decode kernel and the
# float32 CUDA test of the EAGLE-3 draft graphs (graph drafts == eager drafts step by step,
# acceptance identical, greedy == speculation off), (2) the draft step with / without its graphs
# (k2-slice 3 layers, K2.5 sizes), (3) the peaked bf16 k2-slice eagle3 tests (greedy ==
# speculation off, draft graphs replayed) in the time left.
# Usage (from the repo root): bash benchmarks/eagle_graphs_check.sh ; full logs in $OUT/eagle_*.txt
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/k2out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:src; else export PYTHONPATH=src; fi
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
