#!/bin/bash
# Served throughput and TTFT (issue 28 "Served" targets) on one GPU: `k2serve serve` on a 6-layer
# k2-slice INT4 (dummy weights), `k2serve bench` at C = 1, 16, 256 with 2C requests (C=1: one),
# random 1K-token prompts, 256 output tokens; the model alone timed in the same run. SERVER_ARGS:
# more serve flags (e.g. "--max-num-batched-tokens 8192"); TAG names the output files.
# Usage (repo root): OUT=/some/dir [SERVER_ARGS=...] [TAG=x] bash benchmarks/served_check.sh
cd "$(dirname "$0")/.." || exit 1
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tag=${TAG:-served}
mkdir -p "$OUT/$tag"
timeout ${LIMIT:-400} python3 benchmarks/served.py --layers 6 --concurrency ${CONC:-1,16,256} \
  --no-prefix --server-args "${SERVER_ARGS:-}" --out "$OUT/$tag" 2>&1 | tee "$OUT/${tag}_table.txt"
echo "(rc=${PIPESTATUS[0]} at ${SECONDS}s)"
grep -E "warm-up" "$OUT/$tag/server.log" | tail -2
rm -f "$OUT/$tag"/random_c1.json "$OUT/$tag"/random_c256.json  # files back: at most 8
