"""The int8 prefill graph against the 4-bit graph on prompt chunks: same bundle, same process, interleaved rounds.

Prints, per chunk size, the best of each round's time for a fresh prompt of that many tokens on each graph and the
ratio; then the seconds each session took to open and the process's RSS with both. The bundle must have a prefill
graph (`lineside build` makes one by default for quantized cpu bundles).

    python benchmarks/prefill_graph.py --bundle bundles/smollm2-w4a16 [--threads 2] [--rounds 5]
        [--chunks 2,8,16,64,256,512]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import time

import numpy as np

from lineside.bundle import open_bundle
from lineside.runtime.backend import StepBatch
from lineside.runtime.onnxruntime_backend import PREFILL_ENV, OnnxRuntimeBackend


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def chunk_ms(be: OnnxRuntimeBackend, ids: np.ndarray, session: object, repeats: int) -> float:
    """Best of ``repeats`` runs of one prompt chunk from position 0 on ``session``, in ms."""
    batch = StepBatch.single(0, ids, 0)
    best = float("inf")
    for _ in range(repeats):
        be.reset_slot(0)
        t = time.perf_counter()
        be._run(batch, session=session)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="runs per chunk per round (the best counts)")
    ap.add_argument("--chunks", default="2,8,16,64,256,512")
    args = ap.parse_args()
    bundle = open_bundle(args.bundle)
    if bundle.flavor("cpu").prefill_graph is None:
        raise SystemExit(f"{args.bundle} has no prefill graph: rebuild it without --no-prefill-graph")
    rss0 = rss_mb()
    os.environ[PREFILL_ENV] = "0"
    t0 = time.perf_counter()
    base = OnnxRuntimeBackend(bundle, threads=args.threads)
    base_s = time.perf_counter() - t0
    rss_base = rss_mb() - rss0
    base.close()
    del base
    gc.collect()
    os.environ[PREFILL_ENV] = "1"
    rss0 = rss_mb()
    t0 = time.perf_counter()
    both = OnnxRuntimeBackend(bundle, threads=args.threads)
    both_s = time.perf_counter() - t0
    rss_both = rss_mb() - rss0
    rng = np.random.default_rng(0)
    chunks = [int(c) for c in args.chunks.split(",")]
    limit = min(bundle.max_seq_len, both.vocab_size)
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for n in chunks:
            if n > bundle.max_seq_len:
                continue
            ids = rng.integers(10, limit, n)
            for label, session in (("int8", both.prefill_session), ("4-bit", both.session)):
                times.setdefault((n, label), []).append(chunk_ms(both, ids, session, args.repeats))
    print(f"{args.bundle}, {args.threads} threads, {args.rounds} interleaved rounds (median of each round's best):")
    print(f"{'chunk':>6s} {'4-bit ms':>9s} {'int8 ms':>9s} {'4-bit tok/s':>12s} {'int8 tok/s':>11s} {'speedup':>8s}")
    for n in chunks:
        if (n, "int8") not in times:
            continue
        a, b = statistics.median(times[n, "4-bit"]), statistics.median(times[n, "int8"])
        print(f"{n:6d} {a:9.2f} {b:9.2f} {n / a * 1e3:12.0f} {n / b * 1e3:11.0f} {a / b:7.2f}x")
    print(f"open: 4-bit graph alone {base_s:.2f} s (+{rss_base:.0f} MB resident), both graphs {both_s:.2f} s "
          f"(+{rss_both:.0f} MB)")


if __name__ == "__main__":
    main()
