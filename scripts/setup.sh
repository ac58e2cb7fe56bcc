#!/usr/bin/env bash
# Create .venv and install k2serve into it. Usage: scripts/setup.sh [EXTRAS]   (e.g. "test")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# The CPU build of torch; on this kind of machine pip takes it from a local wheel.
.venv/bin/python -m pip install -q torch==2.13.0
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
