"""Decode steps of the backend alone at 1 and N rows: the most any server on it can scale N streams.

The engine and the server add work on top of ``OnnxRuntimeBackend.forward``; this times that call alone (the
cached-binding decode path the engine takes), N rows decoding together against one row, over the same past
lengths as ``served_side_by_side.py``'s greedy 128-token streams (a short prompt, then 128 steps). Rounds
interleave 1 row and N rows, so both see the same machine. The ratio ``N * t(1) / t(N)`` bounds the aggregate
tokens/s of N streams over one stream, whatever serves them.

    python benchmarks/decode_rows.py --bundle B [--threads 2] [--rows 8] [--prompt-tokens 12] [--steps 128]
        [--rounds 5] [--int8] [--onnxruntime-kernel]

``--onnxruntime-kernel`` also times the 4-bit graph on onnxruntime's own MatMulNBits (``LINESIDE_ROWS_KERNEL=0``)
in the same rounds: what the rows kernel (runtime/rows_kernel.py) gives. ``--int8`` also times the same steps with ``LINESIDE_DECODE_GRAPH=int8`` (every step on the bundle's int8 graph), in
the same rounds: what that throughput mode costs one stream and gives eight.

Timing only: no pass/fail.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lineside.bundle import open_bundle  # noqa: E402
from lineside.runtime import rows_kernel  # noqa: E402
from lineside.runtime.backend import StepBatch  # noqa: E402
from lineside.runtime.onnxruntime_backend import DECODE_GRAPH_ENV, OnnxRuntimeBackend  # noqa: E402


def decode_ms(be: OnnxRuntimeBackend, rows: int, prompt: int, steps: int) -> float:
    """Median ms per decode step of ``rows`` rows over pasts ``prompt .. prompt + steps - 1`` (cache contents
    don't change the cost: attention reads every past entry either way)."""
    slots = list(range(rows))
    times = []
    for i in range(steps):
        batch = StepBatch(slots=slots, input_ids=np.full((rows, 1), 100, np.int64),
                          past_lengths=np.full(rows, prompt + i, np.int64), new_lengths=np.ones(rows, np.int64),
                          logits_positions=np.zeros((rows, 1), np.int64))
        t0 = time.perf_counter()
        be.forward(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=12, help="past length of the first decode step")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--int8", action="store_true", help="also time LINESIDE_DECODE_GRAPH=int8, interleaved")
    ap.add_argument("--onnxruntime-kernel", action="store_true",
                    help="also time the 4-bit graph on onnxruntime's own MatMulNBits (LINESIDE_ROWS_KERNEL=0), "
                         "interleaved: what the rows kernel gives")
    a = ap.parse_args()
    bundle = open_bundle(a.bundle)
    kernel = "rows kernel" if rows_kernel.library() is not None else "onnxruntime's kernel"
    print(f"the default 4-bit graph runs on {kernel} ({rows_kernel.host_ok() or 'this CPU can run the rows kernel'})")
    graphs = {"4-bit": OnnxRuntimeBackend(bundle, num_slots=a.rows, threads=a.threads)}
    if a.onnxruntime_kernel:
        os.environ[rows_kernel.ENV] = "0"
        graphs["4-bit onnxruntime kernel"] = OnnxRuntimeBackend(bundle, num_slots=a.rows, threads=a.threads)
        del os.environ[rows_kernel.ENV]
    if a.int8:
        os.environ[DECODE_GRAPH_ENV] = "int8"
        graphs["int8"] = OnnxRuntimeBackend(bundle, num_slots=a.rows, threads=a.threads)
        del os.environ[DECODE_GRAPH_ENV]
    be = graphs["4-bit"]
    if a.prompt_tokens + a.steps > be.max_seq_len:
        raise SystemExit(f"--prompt-tokens {a.prompt_tokens} + --steps {a.steps} pass the bundle's context of "
                         f"{be.max_seq_len}; ask for fewer")
    for g in graphs.values():
        for rows in (1, a.rows):  # warm-up: the first runs of a shape allocate
            decode_ms(g, rows, a.prompt_tokens, 8)
    one: dict[str, list[float]] = {name: [] for name in graphs}
    many: dict[str, list[float]] = {name: [] for name in graphs}
    for r in range(a.rounds):
        runs = [(name, rows) for name in graphs for rows in (1, a.rows)]
        for name, rows in (runs if r % 2 == 0 else runs[::-1]):
            (one if rows == 1 else many)[name].append(decode_ms(graphs[name], rows, a.prompt_tokens, a.steps))
        print(f"round {r + 1}: " + "; ".join(
            f"{name}: 1 row {one[name][-1]:.2f} ms/step, {a.rows} rows {many[name][-1]:.2f} ms/step = "
            f"{a.rows * one[name][-1] / many[name][-1]:.2f}x" for name in graphs), flush=True)
    for name in graphs:
        o, m = one[name], many[name]
        ratios = sorted(a.rows * x / y for x, y in zip(o, m, strict=True))
        print(f"{name} graph, threads {a.threads}, past {a.prompt_tokens}..{a.prompt_tokens + a.steps - 1}: 1 row "
              f"{statistics.median(o):.2f} ms/step ({1e3 / statistics.median(o):.1f} tok/s), {a.rows} rows "
              f"{statistics.median(m):.2f} ms/step ({a.rows * 1e3 / statistics.median(m):.1f} tok/s); "
              f"{a.rows} rows / 1 row: median {statistics.median(ratios):.2f}x ({ratios[0]:.2f}..{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
