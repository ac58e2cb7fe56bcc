#!/usr/bin/env bash
# Set up (if needed) and run the whole CPU test suite plus the linter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check src tests
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
