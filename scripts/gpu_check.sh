#!/usr/bin/env bash
# All TensorRT GPU checks + a short decode benchmark (tokens/s, TTFT); < 5 minutes on one GPU.
# Needs: an NVIDIA GPU + driver, cuda-python + NVRTC, and TensorRT (python) for all but the CUDA-only checks.
# Prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# A GPU is required; TensorRT is not: without it the CUDA half (NVRTC kernels, graph capture) still runs.
python -c "
import sys
from trtedge.errors import TrtedgeError
from trtedge.runtime.trt_env import probe_gpu
try:
    print(probe_gpu())
except TrtedgeError as e:
    sys.exit(f'gpu_check: {e}')
" || exit 2
HAVE_TRT=1
python -c "from trtedge.runtime.trt_env import import_tensorrt; import_tensorrt()" 2>/dev/null || HAVE_TRT=0
timeout 150 python -m pytest -q -rs tests/gpu -p no:cacheprovider 2>&1 | tail -15
TESTS_RC=${PIPESTATUS[0]}
if [ "$HAVE_TRT" = 0 ]; then
  python -c "
from trtedge.runtime.trt_env import import_tensorrt, probe_gpu
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
timeout 140 python - "$WORK" "$TESTS_RC" <<'PY'
import sys, time
from pathlib import Path
import numpy as np
sys.path.insert(0, "tests")
from conftest import DENSE_VARIANTS, make_tiny_dense, smollm2_gguf
from trtedge.build.engine.builder import BuildOptions as EO, build_engine
from trtedge.build.pipeline import BuildOptions, build_bundle
from trtedge.bundle import open_bundle
from trtedge.runtime.backend import StepBatch
from trtedge.runtime.tensorrt_backend import TensorRTBackend
from trtedge.runtime.trt_env import probe_gpu, tensorrt_version

work, tests_rc = Path(sys.argv[1]), int(sys.argv[2])
src = smollm2_gguf()
name = "SmolLM2-135M w4a16" if src else "tiny llama w4a16"
if src is None:
    fam, ov = DENSE_VARIANTS["llama-gqa"]
    src = make_tiny_dense(work / "ck", fam, **ov)
t = time.time()
build_bundle(src, work / "b", BuildOptions(quant="w4a16", flavors=("trt",), max_seq_len=1024, group_size=128))
t_bundle = time.time() - t
t = time.time()
build_engine(work / "b", EO(num_slots=4, max_prefill=256))
t_engine = time.time() - t
b = open_bundle(work / "b")
rows = []
for slots in (1, 4):
    be = TensorRTBackend(b, num_slots=slots)
    prompt = np.random.default_rng(0).integers(3, b.config.vocab_size, 128)
    ttft = []
    for s in range(slots):
        be.reset_slot(s)
        t = time.perf_counter()
        be.forward(StepBatch.single(s, prompt, 0))
        ttft.append(time.perf_counter() - t)
    n = 128
    t = time.perf_counter()
    for i in range(n):
        be.forward(StepBatch(slots=list(range(slots)), input_ids=np.full((slots, 1), 5, dtype=np.int64),
                             past_lengths=np.full(slots, 128 + i, dtype=np.int64),
                             new_lengths=np.ones(slots, dtype=np.int64),
                             logits_positions=np.zeros((slots, 1), dtype=np.int64)))
    dt = time.perf_counter() - t
    rows.append((slots, 1000 * float(np.median(ttft)), n * slots / dt, 1000 * dt / n, dict(be.stats)))
    be.close()
gpu = probe_gpu()
print()
print(f"| GPU {gpu.name} SM {gpu.sm} | TensorRT {tensorrt_version()} | CUDA {gpu.cuda_runtime} | gpu tests rc={tests_rc} |")
print(f"| {name}: bundle {t_bundle:.0f}s, engine build {t_engine:.0f}s |")
print("| batch | TTFT 128-tok prompt (ms) | decode tok/s | ms/step | graph replays/captures/eager |")
print("|---|---|---|---|---|")
for slots, ttft, tps, ms, st in rows:
    print(f"| {slots} | {ttft:.1f} | {tps:.0f} | {ms:.2f} | {st['replay']}/{st['captured']}/{st['eager']} |")
PY
BENCH_RC=$?
exit $(( TESTS_RC != 0 || BENCH_RC != 0 ))
