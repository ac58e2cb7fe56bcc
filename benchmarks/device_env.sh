# Sourced by the device scripts (benchmarks/*_check.sh, gpu_check.sh, w5_dispatch.sh): from the
# repo root, installs the wheels carried in .whl (packages the GPU image lacks) into /tmp/site
# once, and puts them and src on PYTHONPATH; unbuffered Python output; OUT defaults to /tmp/k2out.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k2out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:src; else export PYTHONPATH=src; fi
