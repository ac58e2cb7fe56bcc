#!/bin/bash
# w5-eagle's device call (<= 120 s, one H100): the CUDA tests of the EAGLE-3 draft graphs (float32:
# graph drafts == eager drafts, acceptance identical; bf16 peaked k2-slice: greedy == speculation
# off with the draft graphs replayed), then the draft step with / without its graphs.
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
echo "== pytest: the Llama head kernel, draft graphs (float32 graph == eager), peaked bf16 eagle3 greedy identical"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gqa_decode.py tests/engine/test_spec_decode_gpu.py \
  -k "gqa_decode or draft_graphs or (peaked and eagle3)" 2>&1 | tee "$OUT/eagle_pytest.txt" | tail -8
echo "(pytest rc=$? at ${SECONDS}s)"
left=$((116 - SECONDS))
echo "== draft step timing (${left}s left)"
timeout "$left" python3 benchmarks/eagle_graphs_gpu.py --layers 3 --batches 1,16 --iters 12 \
  > "$OUT/eagle_draft_bench.txt" 2>&1
echo "(bench rc=$? at ${SECONDS}s)"
grep -E "^\||^#|FAIL|Error" "$OUT/eagle_draft_bench.txt" | grep -v "Random weights"
