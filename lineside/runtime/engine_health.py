"""Whether the engine can still serve: consecutive failed steps, and the failure that ends it.

A backend that fails on every step (onnxruntime raising, a TensorRT context lost, out of memory) would otherwise
answer each request with a 500 while the node stays ready, so a gateway or probe kept sending traffic to a node
that can only fail. One failed step (a request the backend chokes on) is not that. After ``max_failed_steps`` in a
row with no step succeeding between, the engine runs a probe (the warm-up's tiny forward on a free slot): if it
works, the failures were the requests' own (an OpenAI client retries a 500 twice: one bad prompt is three failed
steps) and the count restarts; if it fails too, the engine failed. An error the backend declares unrecoverable
(``BackendLost``) fails it at once. A step in which any backend forward succeeds resets the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from lineside.errors import LinesideError
from lineside.runtime.request import EngineDraining
from lineside.strenum import StrEnum

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


class Judgement(StrEnum):
    """What a step's outcome means for the engine."""

    SERVING = "serving"  # nothing to do
    PROBE = "probe"  # the limit was reached: a known-good forward decides (the failures may be the requests' own)
    FAILED = "failed"  # the engine failed (a fatal error, or the probe failed too)


class StepHealth:
    """Counts consecutive failed steps; past ``max_failed_steps`` asks for a probe, and holds the failure's line
    once the engine failed (at once on a fatal error)."""

    def __init__(self, max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS):
        if isinstance(max_failed_steps, bool) or not isinstance(max_failed_steps, int) or max_failed_steps < 1:
            raise LinesideError(f"max_failed_steps must be an integer >= 1, got {max_failed_steps!r}")
        self.max_failed_steps = max_failed_steps
        self.consecutive = 0  # failed steps since the last one in which the backend succeeded
        self.failed_total = 0
        self.probes_passed = 0  # limits reached whose probe forward worked: the failing requests were their own
        self.failure: str | None = None  # set once: the engine failed, and why (one line)
        self._last: str | None = None

    def record(self, verdict: StepVerdict) -> Judgement:
        """Count one step."""
        if self.failure is not None:
            return Judgement.SERVING  # reported once
        if verdict.ok and not verdict.fatal:  # the backend works: a failing request was that request's
            self.consecutive = 0
            return Judgement.SERVING
        if not verdict.failed:
            return Judgement.SERVING
        self.consecutive += 1
        self.failed_total += 1
        self._last = verdict.error or "model step failed"
        if verdict.fatal:
            self.failure = self._last
            return Judgement.FAILED
        return Judgement.PROBE if self.consecutive >= self.max_failed_steps else Judgement.SERVING

    def judge_probe(self, probe_error: str | None) -> Judgement:
        """The probe's outcome after ``PROBE``: None (it worked) resets the count; an error fails the engine."""
        if probe_error is None:
            self.consecutive = 0
            self.probes_passed += 1
            return Judgement.SERVING
        self.failure = (f"{self.consecutive} consecutive model steps failed, the last with: {self._last}; "
                        f"a probe forward failed too ({probe_error})")
        return Judgement.FAILED
