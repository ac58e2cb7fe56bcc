#!/bin/bash
# Wave 8 checks on one GPU: GPU tests (kernels, engine, model), the 8K prompt step's kernel split
# with the expanded and absorbed MLA (model_speed --parts pprof), the served bench at C=16, 256.
# Parts: tests, fidelity, model, mlasweep, dprof (decode kernel split, uniform routing), mixed
# (eager mixed steps: GPU vs host time), pprof, served, served2.
# Usage (repo root, .whl carried): OUT=/dir [PARTS="tests pprof served"] [FORMAT=fp8] bash benchmarks/w8_check.sh
cd "$(dirname "$0")/.." || exit 1
source benchmarks/device_env.sh
export PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for part in ${PARTS:-tests pprof served}; do
  case $part in
  tests)
    timeout ${TLIMIT:-220} python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels \
      tests/engine tests/model > "$OUT/gpu_tests.txt" 2>&1
    echo "tests rc=$? at ${SECONDS}s"; tail -n 4 "$OUT/gpu_tests.txt" ;;
  fidelity)
    timeout 150 python3 benchmarks/fidelity.py --formats int4,fp8 --batches 1,8 > "$OUT/fidelity.txt" 2>&1
    echo "fidelity rc=$? at ${SECONDS}s"; grep -iE "ok|fail|budget" "$OUT/fidelity.txt" | tail -12 ;;
  model)
    timeout 200 python3 benchmarks/model_speed.py --parts ceil,model --layers 3 \
      --routing dummy,uniform --quick --format ${FORMAT:-int4} > "$OUT/model_${FORMAT:-int4}.txt" 2>&1
    echo "model rc=$? at ${SECONDS}s"; grep -E "^\| model|ceilings" "$OUT/model_${FORMAT:-int4}.txt" | head -30 ;;
  mlasweep)
    timeout 150 python3 benchmarks/model_speed.py --parts ceil,mlasweep --layers 3 > "$OUT/mlasweep.txt" 2>&1
    echo "mlasweep rc=$? at ${SECONDS}s"; grep -E "^\| mla|ceilings" "$OUT/mlasweep.txt" ;;
  dprof)
    timeout 150 python3 benchmarks/model_speed.py --parts ceil,dprof --layers 3 > "$OUT/dprof.txt" 2>&1
    echo "dprof rc=$? at ${SECONDS}s"; grep -E "^\| dprof|ceilings|FAIL|Error" "$OUT/dprof.txt" ;;
  mixed)
    timeout 150 python3 benchmarks/model_speed.py --parts ceil,mixed --layers ${LAYERS:-6} > "$OUT/mixed.txt" 2>&1
    echo "mixed rc=$? at ${SECONDS}s"; grep -E "^\| mixed|ceilings|FAIL|Error" "$OUT/mixed.txt" ;;
  pprof)
    timeout 150 python3 benchmarks/model_speed.py --parts ceil,pprof --layers 3 > "$OUT/pprof.txt" 2>&1
    echo "pprof rc=$? at ${SECONDS}s"; grep -E "^\| pprof|ceilings" "$OUT/pprof.txt" ;;
  served|served2)
    timeout 200 python3 benchmarks/served.py --layers 6 --concurrency ${CONC:-16,256} --no-prefix \
      --server-args "${SERVER_ARGS:-}" --out /tmp/served ${SPY:+--py-spy $OUT/spy_$part.txt} \
      > "$OUT/$part.txt" 2>&1
    echo "served rc=$? at ${SECONDS}s"
    if [ -n "$SPY" ]; then
      python3 benchmarks/spy_summary.py "$OUT/spy_$part.txt" --top 30 > "$OUT/spy_${part}_sum.txt"
      sed -n '/k2serve-engine/,/^==/p' "$OUT/spy_${part}_sum.txt" | head -16
    fi
    grep -A3 "^workload" "$OUT/$part.txt"; grep "model alone" "$OUT/$part.txt"
    grep -E "switch interval|warm-up" /tmp/served/server.log | tail -3 ;;
  esac
done
