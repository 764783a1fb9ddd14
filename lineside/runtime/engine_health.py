"""Whether the engine can still serve: consecutive failed steps, and the failure that ends it.

A backend that fails on every step (onnxruntime raising, a TensorRT context lost, out of memory) would otherwise
answer each request with a 500 while the node stays ready, so a gateway or probe kept sending traffic to a node
that can only fail. One failed step (a request the backend chokes on) is not that: only ``max_failed_steps`` in a
row with no step succeeding between, or an error the backend declares unrecoverable (``BackendLost``), fail the
engine; a step in which any backend call succeeds resets the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from lineside.errors import LinesideError
from lineside.runtime.request import EngineDraining

DEFAULT_MAX_FAILED_STEPS = 3  # consecutive failed steps that fail the engine (serve --max-failed-steps)


class BackendLost(LinesideError):
    """Raised by a backend whose device state cannot be trusted again (a lost CUDA context, a sticky device
    error): the engine fails at once instead of waiting for more steps to fail."""


class EngineFailed(EngineDraining):
    """The engine failed (see ``LLMEngine.failure``) and takes no requests again: a draining engine's 503, so
    every route that refuses a stopping engine's request refuses this one the same way."""


@dataclass(frozen=True)
class StepVerdict:
    """What one step tells about the backend: ``ok`` backend calls succeeded, ``failed`` raised (``error``: the
    first one's line; ``fatal``: one raised BackendLost). A step with neither (sampling only) tells nothing."""

    ok: int = 0
    failed: int = 0
    error: str | None = None
    fatal: bool = False


class StepHealth:
    """Counts consecutive failed steps; past ``max_failed_steps`` (or on a fatal error) holds the failure's line."""

    def __init__(self, max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS):
        if isinstance(max_failed_steps, bool) or not isinstance(max_failed_steps, int) or max_failed_steps < 1:
            raise LinesideError(f"max_failed_steps must be an integer >= 1, got {max_failed_steps!r}")
        self.max_failed_steps = max_failed_steps
        self.consecutive = 0  # failed steps since the last one in which the backend succeeded
        self.failed_total = 0
        self.failure: str | None = None  # set once: the engine failed, and why (one line)

    def record(self, verdict: StepVerdict) -> bool:
        """Count one step; True when it is the one that fails the engine (only once)."""
        if self.failure is not None:
            return False
        if verdict.ok and not verdict.fatal:  # the backend works: a failing request was that request's
            self.consecutive = 0
            return False
        if not verdict.failed:
            return False
        self.consecutive += 1
        self.failed_total += 1
        if verdict.fatal or self.consecutive >= self.max_failed_steps:
            why = verdict.error or "model step failed"
            self.failure = (why if verdict.fatal else
                            f"{self.consecutive} consecutive model steps failed, the last with: {why}")
            return True
        return False
