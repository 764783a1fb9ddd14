#!/usr/bin/env bash
# Set up (.venv with the dev extra) and run the whole test suite. Exits non-zero if no test ran.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev || { echo "setup failed"; exit 1; }
.venv/bin/ruff check trtedge tests build_engine.py benchmarks || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose"
  exit 1
fi
exit "$rc"
