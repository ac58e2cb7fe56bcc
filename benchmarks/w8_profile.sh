#!/bin/bash
# Wave 8, issue 28: where a prompt step's GPU time goes (model_speed --parts pprof, 3 layers,
# T=8192) and where the served engine's host time goes (served.py under py-spy at C=16 and 256).
# Usage (repo root, .whl carried with the py-spy wheel): OUT=/dir bash benchmarks/w8_profile.sh
cd "$(dirname "$0")/.." || exit 1
source benchmarks/device_env.sh
export PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
which py-spy || echo "py-spy missing"
timeout 150 python3 benchmarks/model_speed.py --parts ceil,pprof --layers 3 > "$OUT/pprof.txt" 2>&1
echo "pprof rc=$? at ${SECONDS}s"; grep -E "pprof|ceilings" "$OUT/pprof.txt" | tail -12
for c in ${CONC:-16 256}; do
  timeout ${LIMIT:-200} python3 benchmarks/served.py --layers 6 --concurrency $c --no-prefix \
    --py-spy "$OUT/spy$c.txt" --server-args "${SERVER_ARGS:-}" --out /tmp/served$c > "$OUT/s$c.txt" 2>&1
  echo "served C=$c rc=$? at ${SECONDS}s"; tail -n 5 "$OUT/s$c.txt"
  [ -f "$OUT/spy$c.txt" ] && python3 benchmarks/spy_summary.py "$OUT/spy$c.txt" --top 30 \
    > "$OUT/spy${c}_sum.txt" && grep -A12 "k2serve-engine" "$OUT/spy${c}_sum.txt" | head -14
  tail -n 3 /tmp/served$c/server.log
done
