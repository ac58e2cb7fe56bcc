#!/bin/bash
# A/B of two source trees on one machine: `cpu_e2e.py --full-k2` (16 threads, 8K and 1K context)
# alternated twice, each tree with its own CPU kernel build. Make the trees first, e.g.
#   mkdir -p .wt/pre .wt/post && git archive REV_A | tar -x -C .wt/pre && git archive REV_B | tar -x -C .wt/post
# then (repo root): OUT=$OUT bash benchmarks/cpu_e2e_ab.sh .wt/pre .wt/post
# (wave 10's run 5: pre = d21df1b, post = main after the fused merge). Full outputs:
# $OUT/ab_<tree>_<round>.txt; the main rows printed.
OUT=${OUT:-/tmp/o}; mkdir -p "$OUT"
A=${1:?first tree}; B=${2:?second tree}
E2E="benchmarks/cpu_e2e.py --full-k2 --experts 48 --context 8192 --also-context 1024 --decode-only"
for t in "$A" "$B"; do
  (cd "$t" && PYTHONPATH=src timeout 60 python3 -c "from k2serve.kernels import cpu as ck; print('$t kernel', ck.load_kernel('auto') is not None)")
done
for r in 1 2; do for t in "$A" "$B"; do
  n=$(basename "$t")
  (cd "$t" && PYTHONPATH=src timeout 60 python3 $E2E > "$OUT/ab_${n}_$r.txt" 2>&1; echo "$n $r rc=$?")
  grep -E "^(attention proj|MLA over|shared expert  |routed|router|lm_head|EXTRAP)|^# read bandwidth" "$OUT/ab_${n}_$r.txt" | cut -c1-150
done; done
