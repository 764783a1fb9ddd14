#!/usr/bin/env bash
# All TensorRT GPU checks + a short decode benchmark (tokens/s, TTFT); < 5 minutes on one GPU.
# Needs: an NVIDIA GPU + driver, cuda-python + NVRTC, and TensorRT (python) for all but the CUDA-only checks.
# Prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
# The venv scripts/setup.sh makes (the system python3 lacks lineside's dependencies), else python3: JetPack's
# Ubuntu and Debian have no `python` command.
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# A GPU is required; TensorRT is not: without it the CUDA half (NVRTC kernels, graph capture) still runs.
"$PY" -c "
import sys
from lineside.errors import LinesideError
from lineside.runtime.tensorrt.env import probe_gpu
try:
    print(probe_gpu())
except LinesideError as e:
    sys.exit(f'gpu_check: {e}')
" || exit 2
HAVE_TRT=1
"$PY" -c "from lineside.runtime.tensorrt.env import import_tensorrt; import_tensorrt()" 2>/dev/null || HAVE_TRT=0
if [ "$HAVE_TRT" = 0 ] && [ "$PY" != python3 ] && python3 -c "import tensorrt" 2>/dev/null; then
  # JetPack's python3-libnvinfer lives in the system's packages, which a plain venv does not see
  echo "gpu_check: python3 imports tensorrt but .venv does not: recreate it with 'python3 -m venv --system-site-packages .venv' (docs/jetson.md), then rerun"
fi
timeout 150 "$PY" -m pytest -q -rs tests/gpu -p no:cacheprovider 2>&1 | tail -15
TESTS_RC=${PIPESTATUS[0]}
if [ "$HAVE_TRT" = 0 ]; then
  "$PY" -c "
from lineside.runtime.tensorrt.env import import_tensorrt, probe_gpu
g = probe_gpu()
try:
    import_tensorrt()
except Exception as e:
    why = str(e)
print()
print(f'| GPU {g.name} SM {g.sm} | CUDA {g.cuda_runtime} | gpu tests rc=$TESTS_RC |')
print(f'| TensorRT: {why} |')
print('| ran: CUDA kernels + graph capture only; engine build, TensorRT logits and the decode benchmark need TensorRT |')
"
  exit $(( TESTS_RC != 0 ))
fi
timeout 140 "$PY" benchmarks/gpu_decode.py "$WORK" --tests-rc "$TESTS_RC"
BENCH_RC=$?
exit $(( TESTS_RC != 0 || BENCH_RC != 0 ))
