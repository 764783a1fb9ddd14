"""Arrival schedules for a load run: burst, Poisson, gamma (with a burstiness factor), fixed concurrency, and
chunked (Poisson arrivals of prompts that are fed in chunks through POST /v1/prefill before their completion).

An open-loop schedule is a seeded list of (send time, prompts carried) decided before the run, so
two runs with the same seed send the same load. Fixed concurrency is closed-loop (a new request
when one finishes): its schedule carries only the worker count and the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lineside.errors import LinesideError

PATTERNS = ("burst", "poisson", "gamma", "concurrency", "chunked")


@dataclass(frozen=True)
class Arrival:
    """One request: when to send it (seconds from the start) and how many prompts it carries."""

    time: float
    prompts: int = 1


@dataclass(frozen=True)
class Schedule:
    """What the runner executes: open-loop arrivals, or `concurrency` workers until the bounds are hit."""

    pattern: str
    arrivals: tuple[Arrival, ...] = ()
    concurrency: int = 0
    max_requests: int = 0
    duration: float = 0.0

    @property
    def closed_loop(self) -> bool:
        return self.concurrency > 0


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise LinesideError(msg)


def _prompt_counts(rng: np.random.Generator, n: int, prompts_per_request: tuple[int, int]) -> np.ndarray:
    lo, hi = prompts_per_request
    _check(1 <= lo <= hi, f"prompts per request {lo}:{hi} is not a range of positive counts; use e.g. 1:3")
    return rng.integers(lo, hi + 1, size=n)


def burst(per_second: int, duration: float, seed: int = 0,
          prompts_per_request: tuple[int, int] = (1, 3), max_requests: int | None = None) -> Schedule:
    """Every whole second t in [0, duration), `per_second` requests sent together, each with 1-3 prompts."""
    _check(per_second >= 1, f"burst needs at least 1 request per second (got {per_second}); set --rate")
    _check(duration > 0, f"burst needs a positive --duration (got {duration})")
    times = np.repeat(np.arange(int(np.ceil(duration)), dtype=np.float64), per_second)
    if max_requests:
        times = times[:max_requests]
    rng = np.random.default_rng(seed)
    counts = _prompt_counts(rng, len(times), prompts_per_request)
    arrivals = tuple(Arrival(float(t), int(c)) for t, c in zip(times, counts, strict=True))
    return Schedule("burst", arrivals, duration=float(duration), max_requests=len(arrivals))


def _from_gaps(pattern: str, gaps_fn, rate: float, duration: float, seed: int, max_requests: int | None,
               prompts_per_request: tuple[int, int]) -> Schedule:
    _check(rate > 0, f"{pattern} arrivals need a positive --rate in requests/s (got {rate})")
    _check(duration > 0 or bool(max_requests), f"{pattern} needs --duration or --num-requests to bound the run")
    rng = np.random.default_rng(seed)
    times: list[float] = []
    t = 0.0
    limit = max_requests or 10_000_000
    while len(times) < limit:
        t += float(gaps_fn(rng))
        if duration > 0 and t >= duration:
            break
        times.append(t)
    counts = _prompt_counts(rng, len(times), prompts_per_request)
    arrivals = tuple(Arrival(tt, int(c)) for tt, c in zip(times, counts, strict=True))
    return Schedule(pattern, arrivals, duration=float(duration), max_requests=len(arrivals))


def poisson(rate: float, duration: float = 0.0, seed: int = 0, max_requests: int | None = None,
            prompts_per_request: tuple[int, int] = (1, 1)) -> Schedule:
    """Poisson arrivals: exponential gaps with mean 1/rate."""
    return _from_gaps("poisson", lambda rng: rng.exponential(1.0 / rate) if rate > 0 else 0.0,
                      rate, duration, seed, max_requests, prompts_per_request)


def gamma(rate: float, burstiness: float = 1.0, duration: float = 0.0, seed: int = 0,
          max_requests: int | None = None, prompts_per_request: tuple[int, int] = (1, 1)) -> Schedule:
    """Gamma gaps with shape=burstiness and mean 1/rate (vLLM's definition: 1 is Poisson, <1 burstier)."""
    _check(burstiness > 0, f"burstiness must be positive (got {burstiness}); 1.0 is Poisson, below 1 is burstier")
    scale = 1.0 / (rate * burstiness) if rate > 0 else 0.0
    return _from_gaps("gamma", lambda rng: rng.gamma(burstiness, scale), rate, duration, seed, max_requests,
                      prompts_per_request)


def concurrency(workers: int, duration: float = 0.0, max_requests: int | None = None) -> Schedule:
    """Closed loop: `workers` requests in flight at all times until the duration or request count is reached."""
    _check(workers >= 1, f"--concurrency must be at least 1 (got {workers})")
    _check(duration > 0 or bool(max_requests), "concurrency needs --duration or --num-requests to bound the run")
    return Schedule("concurrency", concurrency=workers, duration=float(duration), max_requests=max_requests or 0)


def make_schedule(pattern: str, *, rate: float, duration: float, seed: int, burstiness: float = 1.0,
                  workers: int = 1, max_requests: int | None = None,
                  prompts_per_request: tuple[int, int] | None = None) -> Schedule:
    """The schedule the CLI asked for (burst carries 1-3 prompts per request unless told otherwise)."""
    if pattern == "burst":
        _check(float(rate).is_integer(), f"burst sends a whole number of requests each second; --rate {rate} is not one")
        return burst(int(rate), duration, seed, prompts_per_request or (1, 3), max_requests)
    if pattern == "poisson":
        return poisson(rate, duration, seed, max_requests, prompts_per_request or (1, 1))
    if pattern == "gamma":
        return gamma(rate, burstiness, duration, seed, max_requests, prompts_per_request or (1, 1))
    if pattern == "concurrency":
        return concurrency(workers, duration, max_requests)
    if pattern == "chunked":  # when each prompt starts arriving; its chunks and completion follow (bench/client.py)
        s = poisson(rate, duration, seed, max_requests, (1, 1))
        return Schedule("chunked", s.arrivals, duration=s.duration, max_requests=s.max_requests)
    raise LinesideError(f"unknown load pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
