#!/usr/bin/env bash
# Set up (if needed) and run the checks CI runs: formatting, lint of every Python file in the
# repo (benchmarks/ and scripts/ too), the layering contract, the type check, then the CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/lint-imports
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
