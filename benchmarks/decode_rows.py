"""Decode steps of the backend alone at 1 and N rows: the most any server on it can scale N streams.

The engine and the server add work on top of ``OnnxRuntimeBackend.forward``; this times that call alone (the
cached-binding decode path the engine takes), N rows decoding together against one row, over the same past
lengths as ``served_side_by_side.py``'s greedy 128-token streams (a short prompt, then 128 steps). Rounds
interleave 1 row and N rows, so both see the same machine. The ratio ``N * t(1) / t(N)`` bounds the aggregate
tokens/s of N streams over one stream, whatever serves them.

    python benchmarks/decode_rows.py --bundle B [--threads 2] [--rows 8] [--prompt-tokens 12] [--steps 128]
        [--rounds 5]

Timing only: no pass/fail.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lineside.bundle import open_bundle  # noqa: E402
from lineside.runtime.backend import StepBatch  # noqa: E402
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402


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
    a = ap.parse_args()
    be = OnnxRuntimeBackend(open_bundle(a.bundle), num_slots=a.rows, threads=a.threads)
    if a.prompt_tokens + a.steps > be.max_seq_len:
        raise SystemExit(f"--prompt-tokens {a.prompt_tokens} + --steps {a.steps} pass the bundle's context of "
                         f"{be.max_seq_len}; ask for fewer")
    for rows in (1, a.rows):  # warm-up: the first runs of a shape allocate
        decode_ms(be, rows, a.prompt_tokens, 8)
    one, many = [], []
    for r in range(a.rounds):
        order = (1, a.rows) if r % 2 == 0 else (a.rows, 1)
        for rows in order:
            (one if rows == 1 else many).append(decode_ms(be, rows, a.prompt_tokens, a.steps))
        print(f"round {r + 1}: 1 row {one[-1]:.2f} ms/step, {a.rows} rows {many[-1]:.2f} ms/step = "
              f"{a.rows * one[-1] / many[-1]:.2f}x one row's tokens/s", flush=True)
    ratios = sorted(a.rows * o / m for o, m in zip(one, many, strict=True))
    print(f"threads {a.threads}, past {a.prompt_tokens}..{a.prompt_tokens + a.steps - 1}: 1 row "
          f"{statistics.median(one):.2f} ms/step ({1e3 / statistics.median(one):.1f} tok/s), {a.rows} rows "
          f"{statistics.median(many):.2f} ms/step ({a.rows * 1e3 / statistics.median(many):.1f} tok/s); "
          f"{a.rows} rows / 1 row: median {statistics.median(ratios):.2f}x ({ratios[0]:.2f}..{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
