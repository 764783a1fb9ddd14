"""Batch-size and length buckets, and the CUDA Graph capture/replay of the decode step per bucket.

Decode steps are captured once per (batch bucket, tokens per row, logits per row, length bucket): 1-token
decode and speculative verification (the pending token + k drafts, logits at each) alike. Shapes and buffer
addresses are fixed inside a key, so a replay only needs the new inputs copied into the static buffers.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lineside.runtime.engine_health import BackendLost
from lineside.runtime.tensorrt.cuda_errors import sticky
from lineside.runtime.tensorrt.env import check

log = logging.getLogger("lineside.tensorrt")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, ... up to (and always including) ``max_batch``."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return out


def length_buckets(max_seq: int, first: int = 64, step: int = 512) -> list[int]:
    """Past-length buckets: doubling from ``first`` up to ``step``, then every ``step``, ending at ``max_seq``.

    Doubling keeps short contexts cheap; the linear part bounds the attention waste at long
    contexts to ``step`` positions (12% at 4k with step 512) with ~max_seq/step captured graphs.
    """
    if max_seq < 1:
        raise ValueError("max_seq must be >= 1")
    out, b = [], max(1, min(first, max_seq))
    while b < min(step, max_seq):
        out.append(b)
        b *= 2
    b = step * ((b + step - 1) // step) if b >= step else b
    while b < max_seq:
        out.append(b)
        b += step
    out.append(max_seq)
    return sorted(set(out))


def pick_bucket(n: int, buckets: list[int]) -> int:
    """Smallest bucket ≥ n; ValueError when n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class CapturedGraph:
    graph: Any
    exec: Any


@dataclass
class GraphCache:
    """CUDA Graphs per key; a key whose capture failed (or whose replay failed twice) runs eagerly from then on."""

    cudart: Any
    stream: Any
    graphs: dict[tuple[int, ...], CapturedGraph] = field(default_factory=dict)
    failed: dict[tuple[int, ...], str] = field(default_factory=dict)
    recaptured: set[tuple[int, ...]] = field(default_factory=set)  # keys captured again after a failed replay

    def run(self, key: tuple[int, ...], launch: Callable[[], None]) -> str:
        """Replay the graph for ``key`` (capturing it on first use, after one eager run); returns how it ran.

        A replay that fails with a recoverable error runs the step eagerly and captures the key again, once; a
        second failing replay leaves the key eager for good. A sticky error raises BackendLost (cuda_errors.py)."""
        if key in self.graphs:
            res = self.cudart.cudaGraphLaunch(self.graphs[key].exec, self.stream)
            err = res[0] if isinstance(res, tuple) else res
            if int(err) == 0:
                return "replay"
            if sticky(err) is not None:
                check(self.cudart, res, "cudaGraphLaunch")  # raises BackendLost
            self._replay_failed(key, getattr(err, "name", str(err)))
            if key in self.failed:
                launch()
                return "eager"
        if key in self.failed:
            launch()
            return "eager"
        launch()  # the eager run TensorRT needs before capture (allocations, shape-dependent setup)
        check(self.cudart, self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        try:
            self.graphs[key] = self._capture(launch)
        except BackendLost:
            raise
        except Exception as e:  # capture is an optimization: fall back to eager for this key
            self.failed[key] = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("CUDA graph capture for bucket %s failed (%s); that bucket runs eagerly", key, self.failed[key])
        return "captured"

    def _replay_failed(self, key: tuple[int, ...], err: str) -> None:
        """Drop ``key``'s graph after a failed replay: captured again once, then eager (and say which)."""
        self.drop(lambda k: k == key)
        if key in self.recaptured:
            self.failed[key] = f"cudaGraphLaunch failed again after a recapture: {err}"
            log.warning("CUDA graph replay for bucket %s failed again (%s); that bucket runs eagerly from now on",
                        key, err)
        else:
            self.recaptured.add(key)
            log.warning("CUDA graph replay for bucket %s failed (%s); running the step eagerly and capturing the "
                        "bucket again", key, err)

    def _capture(self, launch: Callable[[], None]) -> CapturedGraph:
        cr = self.cudart
        mode = cr.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check(cr, cr.cudaStreamBeginCapture(self.stream, mode), "cudaStreamBeginCapture")
        try:
            launch()
        finally:
            err, graph = cr.cudaStreamEndCapture(self.stream)
        if int(err) != 0 or graph is None:
            raise RuntimeError(f"cudaStreamEndCapture failed: {getattr(err, 'name', err)}")
        err, gexec = cr.cudaGraphInstantiate(graph, 0)
        if int(err) != 0:
            cr.cudaGraphDestroy(graph)
            raise RuntimeError(f"cudaGraphInstantiate failed: {getattr(err, 'name', err)}")
        return CapturedGraph(graph, gexec)

    def drop(self, predicate: Callable[[tuple[int, ...]], bool] = lambda k: True) -> None:
        """Destroy graphs whose key matches (their buffers moved or were resized)."""
        for k in [k for k in self.graphs if predicate(k)]:
            g = self.graphs.pop(k)
            self.cudart.cudaGraphExecDestroy(g.exec)
            self.cudart.cudaGraphDestroy(g.graph)
        for k in [k for k in self.failed if predicate(k)]:
            self.failed.pop(k)
