#!/usr/bin/env bash
# Fetch, as wheels into .whl/ (ignored by git), the packages the server needs that the lent GPU
# machines' image lacks (the device library's KINDS.md lists what it holds), at the versions
# installed in this checkout's .venv, for that machine's Python (3.12, x86-64 manylinux).
# benchmarks/device_env.sh installs them there into /tmp/site; a `run` that needs them names
# .whl in its carry. Without them `k2serve serve` stops at `import uvicorn` on the device
# (benchmarks/served.py, wave 13).
# Usage (repo root, after scripts/setup.sh): bash scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="fastapi uvicorn starlette pydantic pydantic_core annotated-types typing-inspection sniffio
python-multipart xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py
opentelemetry-api"
mkdir -p .whl
for name in $PKGS; do
  ver=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
  plat=()
  for n in 17 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" --platform manylinux2014_x86_64 -d .whl "$name==$ver"
done
du -sh .whl
ls .whl
