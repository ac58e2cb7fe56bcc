#!/bin/bash
# Async scheduling on one GPU (issue 28's served targets): correctness first, then the served
# bench with --async-scheduling and with --no-async-scheduling in the same session.
#   1. pytest: the pipelined engine equals the synchronous one on CUDA (decode graphs, placeholder
#      tokens filled on the device), then every gpu-marked engine test (both under the default,
#      which is async scheduling on);
#   2. benchmarks/served_check.sh (served.py --layers 6 --no-prefix, C = $CONC) with TAG=async
#      and TAG=sync (SERVER_ARGS gets the flag).
# Usage (repo root): OUT=/some/dir [CONC=1,16,256] [PARTS="test async sync"] bash benchmarks/async_check.sh
# Each part fails soft (its error printed, the next part runs). Output: $OUT/async_*.txt.
cd "$(dirname "$0")/.." || exit 1
source benchmarks/device_env.sh
export CONC=${CONC:-1,16,256}
parts=${PARTS:-test async sync}
for part in $parts; do
  case $part in
    test)
      timeout ${TEST_LIMIT:-420} python3 -m pytest -q -m gpu tests/engine -x -p no:cacheprovider \
        2>&1 | tail -25 | tee "$OUT/async_pytest.txt"
      echo "(pytest rc=${PIPESTATUS[0]} at ${SECONDS}s)" ;;
    async|sync)
      flag=--async-scheduling; [ "$part" = sync ] && flag=--no-async-scheduling
      SERVER_ARGS="$flag ${SERVER_ARGS_EXTRA:-}" TAG=async_$part bash benchmarks/served_check.sh \
        > "$OUT/async_served_$part.txt" 2>&1
      echo "(served $part rc=$? at ${SECONDS}s)"
      grep -i "async scheduling" "$OUT/async_$part/server.log" 2>/dev/null | head -1 ;;
  esac
done
echo "== served, async vs sync (random 1K prompts, 256 output tokens) =="
for part in async sync; do
  f="$OUT/async_served_$part.txt"
  [ -f "$f" ] || continue
  echo "-- $part"
  grep -E "^(workload|random|model alone)" "$f"
done
