#!/bin/bash
# Hybrid overlap (issue 33 item 4) on one GPU, in < 200 s: the CPU kernel built first (so no
# step below pays for it), the device-wait probe, the gpu tests of the piecewise / device-wait
# graphs (correctness), then benchmarks/hybrid_moe.py decode (its own checks first), host wait
# (before) and device wait (after) in the same run, with the in-step timeline and the full K2
# extrapolated from it (benchmarks/hybrid_timeline.py), then, if time is left, the fused fidelity
# test (int4), then the gpu tests of the opt-in ways of waiting (ready words, one graph).
# Full output in $OUT/hybrid_*.txt; the results table printed.
# Usage (repo root): bash benchmarks/hybrid_overlap_check.sh
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/k2out}
mkdir -p "$OUT"
case ":${PYTHONPATH}:" in *":src:"*) ;; *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src ;; esac
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

echo "== build the CPU expert kernel (cached)"
timeout 45 python3 -c "from k2serve.kernels import cpu as ck; print('kernel', ck.load_kernel('auto') is not None)" \
  > "$OUT/hybrid_build.txt" 2>&1
echo "(rc=$? at ${SECONDS}s)"; tail -2 "$OUT/hybrid_build.txt"

echo "== probe: stream wait on a host flag inside a CUDA graph"
timeout 30 python3 -c "
import logging, torch; logging.basicConfig(level=logging.INFO)
from k2serve.kernels.stream_wait import cuda_host_signal_supported
d = torch.cuda.current_device()
print('device wait supported: stream waits', cuda_host_signal_supported(d),
      'spinning kernels', cuda_host_signal_supported(d, True))" \
  > "$OUT/hybrid_probe.txt" 2>&1
echo "(rc=$? at ${SECONDS}s)"; tail -3 "$OUT/hybrid_probe.txt"

echo "== pytest -m gpu tests/integration/test_piecewise_graphs.py (piecewise / device-wait graphs)"
timeout 75 python3 -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_piecewise_graphs.py \
  > "$OUT/hybrid_pytest.txt" 2>&1
echo "(rc=$? at ${SECONDS}s)"; tail -8 "$OUT/hybrid_pytest.txt"

left=$((178 - SECONDS)); [ "$left" -lt 40 ] && left=40
echo "== hybrid_moe.py --quick --parts checks,decode --no-layerwise (limit ${left}s)"
timeout "$left" python3 benchmarks/hybrid_moe.py --quick --parts checks,decode --no-layerwise \
  --watchdog $((left - 5)) > "$OUT/hybrid_bench.txt" 2>&1
echo "(rc=$? at ${SECONDS}s)"
grep -E "^== results|^  (check|decode) |^  B=|FAILED|Traceback|Error" "$OUT/hybrid_bench.txt" | tail -72

left=$((196 - SECONDS))
if [ "$left" -ge 20 ]; then  # what time is left: the fused fidelity variants (split + graphs)
  echo "== pytest fidelity int4 (experts split + piecewise graphs within bf16; limit ${left}s)"
  timeout "$left" python3 -m pytest -q -p no:cacheprovider \
    "tests/integration/test_fidelity.py::test_fused_gpu_paths_within_bf16_rounding[int4]" \
    > "$OUT/hybrid_fidelity.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"; tail -4 "$OUT/hybrid_fidelity.txt"
fi

left=$((198 - SECONDS))
if [ "$left" -ge 15 ]; then  # the opt-in ways (ready words, one graph): their gpu tests
  echo "== pytest -m gpu tests/integration/test_hybrid_timeline.py (limit ${left}s)"
  timeout "$left" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/integration/test_hybrid_slow_cpu.py tests/integration/test_hybrid_timeline.py \
    > "$OUT/hybrid_pytest_timeline.txt" 2>&1
  echo "(rc=$? at ${SECONDS}s)"; tail -4 "$OUT/hybrid_pytest_timeline.txt"
fi
