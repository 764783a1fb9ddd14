"""SloGuard: the server's side of the SLO ladder. It owns the controller, the signals, the fallback engine,
the response cache and the batch gate, and answers the router's one question per request: which engine,
at which level. It ticks in its own asyncio task, outside the engine's step loop.

A request is routed once, when it is submitted; switching levels never moves a request already taken, so
every accepted request completes on the engine that took it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from lineside.runtime.request import FinishReason, Mode, Priority, QueueFullError, RequestHandle
from lineside.runtime.serving import ServingEngine
from lineside.server.metrics import RequestRecord
from lineside.server.slo.cache import ResponseCache
from lineside.server.slo.controller import Level, Reason, SloController, Transition
from lineside.server.slo.policy import SloPolicy
from lineside.server.slo.signals import Signals, SignalSource, read_device
from lineside.server.slo.view import SloStatus

log = logging.getLogger("lineside.server.slo")


class ClientGone(Exception):
    """A request's client disconnected before it reached an engine (while held at the level-1 batch gate)."""


@dataclass(frozen=True)
class Route:
    """Where one request goes: ``engine`` with ``model`` as the name in its response, at ``level``."""

    engine: ServingEngine
    model: str
    level: Level
    fallback: bool


class SloMetrics:
    """The guard's families in the server's registry (vLLM-style names under lineside_)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.level = Gauge("lineside_slo_degradation_level", "Degradation level (0 normal, 1 protect realtime, "
                           "2 fallback and cache)", registry=registry)
        self.transitions = Counter("lineside_slo_transitions", "Level changes by new level and reason",
                                   ["level", "reason"], registry=registry)
        self.fallback = Counter("lineside_slo_fallback_requests", "Requests routed to the fallback bundle",
                                registry=registry)
        self.cache = Counter("lineside_slo_cache_lookups", "Response-cache lookups at level 2 by result",
                             ["result"], registry=registry)
        self.batch_held = Counter("lineside_slo_batch_held", "Batch requests held back at level 1 before admission",
                                  registry=registry)
        self.first_token_timeouts = Counter("lineside_slo_first_token_timeouts",
                                            "Requests that timed out before their first token", registry=registry)
        self.finished = Counter("lineside_slo_finished_requests", "Finished requests by mode and whether they "
                                "completed (stop/length) in time", ["mode", "on_time"], registry=registry)
        self.signal = Gauge("lineside_slo_signal", "The controller's last reading of each signal (NaN: unknown)",
                            ["signal"], registry=registry)
        for reason in ("ttft_p90_s", "queue_wait_p90_s", "kv_usage", "memory_ratio", "gpu_load"):
            self.signal.labels(reason).set(float("nan"))
        for level in Level:  # every series exists from the first scrape (rate() and alerts see a 0 → 1 step)
            for reason in Reason:
                if reason != Reason.NORMAL:
                    self.transitions.labels(str(int(level)), reason.value)
        for result in ("hit", "miss"):
            self.cache.labels(result)
        for mode in Mode:
            for on_time in ("true", "false"):
                self.finished.labels(mode.value, on_time)


class SloGuard:
    """One per server; ``start`` loads the fallback (if any) beside the primary and starts ticking."""

    def __init__(self, policy: SloPolicy, *, registry: CollectorRegistry | None = None,
                 fallback: str | os.PathLike[str] | ServingEngine | None = None,
                 fallback_name: str | None = None, engine_kwargs: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 local_time: Callable[[], dt.time] = lambda: dt.datetime.now().time(),
                 device: Callable[[], tuple[float | None, float | None]] = read_device, ticking: bool = True):
        self.policy = policy
        self.clock = clock
        self.local_time = local_time
        self.metrics = SloMetrics(registry or CollectorRegistry())
        self.metrics.level.set(0)
        self.signals = SignalSource(window_s=policy.window_s, min_samples=policy.min_samples, clock=clock,
                                    device=device)
        self.controller = SloController(policy, now=clock(), on_transition=self._transition)
        self.cache = ResponseCache(max_entries=policy.cache.max_entries, ttl_s=policy.cache.ttl_s, clock=clock,
                                   max_bytes=max(int(policy.cache.max_mb * (1 << 20)), 1))
        self._fallback_source = fallback
        self.fallback: ServingEngine | None = None if isinstance(fallback, (str, os.PathLike)) else fallback
        self._owns_fallback = self.fallback is None and fallback is not None
        self.fallback_name = fallback_name or (Path(fallback).name if isinstance(fallback, (str, os.PathLike))
                                               else getattr(fallback, "model_name", None))
        self.engine_kwargs = engine_kwargs or {}
        self.primary: ServingEngine | None = None
        self.primary_name = ""
        self.ticking = ticking
        self._task: asyncio.Task | None = None
        self._batch_running: set[RequestHandle] = set()
        self.held = 0  # batch requests waiting at the level-1 gate (they count as waiting: /metrics, the bound)

    def attach(self, registry: CollectorRegistry) -> None:
        """Export the guard's families in the server's registry (create_app calls it before serving)."""
        self.metrics = SloMetrics(registry)
        self.metrics.level.set(int(self.controller.level))

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self, primary: ServingEngine, primary_name: str) -> None:
        """Load and warm the fallback (before the server reports ready), then tick every policy.tick_s."""
        self.primary, self.primary_name = primary, primary_name
        if self._owns_fallback:
            from lineside.errors import LinesideError
            from lineside.runtime.engine import LLMEngine

            try:
                self.fallback = await asyncio.to_thread(LLMEngine, self._fallback_source, **self.engine_kwargs)
            except LinesideError as e:  # its files have the primary's names: say which bundle failed
                raise LinesideError(f"--fallback {self._fallback_source}: {e}") from None
        if self.fallback is not None:
            await self.fallback.start()
            log.info("fallback %s ready", self.fallback_name)
        if self.ticking:
            self._task = asyncio.create_task(self._run(), name="lineside-slo")

    async def stop(self, drain_timeout: float = 0.0) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._task = None
        if self.fallback is not None and (self._owns_fallback or self.fallback is not self.primary):
            try:
                await self.fallback.stop(drain_timeout)
            except Exception:  # noqa: BLE001 - shutting down
                log.exception("fallback stop failed")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.tick_s)
            try:
                device = await asyncio.to_thread(self.signals.device)
                self.tick(device=device)
            except Exception:  # noqa: BLE001 - the guard must keep running; the engine is not its to stop
                log.exception("SLO controller tick failed")

    # ---- the controller --------------------------------------------------------------------------------
    def tick(self, *, device: tuple[float | None, float | None] | None = None) -> Level:
        """Read the signals and step the controller once (the task calls it; tests call it with a fake clock)."""
        stats = None
        if self.primary is not None:
            try:
                stats = self.primary.stats()
            except Exception:  # noqa: BLE001 - a stopping engine: no KV reading this tick
                stats = None
        reader = self.signals.device
        if device is not None:
            self.signals.device = lambda: device
        try:
            signals = self.signals.read(stats)
        finally:
            self.signals.device = reader
        for name, value in signals.to_json().items():
            if name != "ttft_samples":
                self.metrics.signal.labels(name).set(float("nan") if value is None else value)
        return self.controller.evaluate(signals, now=self.clock(), local_time=self.local_time())

    def _transition(self, transition: Transition) -> None:
        self.metrics.level.set(int(transition.new))
        self.metrics.transitions.labels(str(int(transition.new)), transition.reason.value).inc()
        log.warning("SLO level %d -> %d (%s)", transition.old, transition.new, transition.reason)

    @property
    def level(self) -> Level:
        return self.controller.level

    # ---- routing -------------------------------------------------------------------------------------
    def route(self, *, mode: Mode, priority: Priority, tokens: int, top_token: int = -1,
              primary_only: bool = False) -> Route:
        """The engine a new request goes to: the fallback at level 2, or at level 1 for the policy's modes and
        priorities; the primary when there is no fallback or the request does not fit the fallback: its context
        (``tokens``: prompt + budget) or its vocabulary (``top_token``: the prompt's largest id; one tokenizer, but
        the fallback may have fewer embedding rows), or only the primary can serve it (``primary_only``: a LoRA
        adapter), or the fallback failed for good (it would refuse every request while the primary still serves)."""
        assert self.primary is not None
        level = self.controller.level
        wants_fallback = level >= Level.FALLBACK or (
            level >= Level.PROTECT_REALTIME and (mode in self.policy.fallback_modes
                                                 or priority in self.policy.fallback_priorities))
        fits = (self.fallback is not None and self.fallback_failure is None and not primary_only
                and tokens <= int(getattr(self.fallback, "max_seq_len", 0))
                and top_token < int(getattr(self.fallback, "vocab_size", top_token + 1)))
        if wants_fallback and fits:  # counted by routing.plan once no cache answer stands in for the bundle
            return Route(self.fallback, self.fallback_name, level, fallback=True)
        return Route(self.primary, self.primary_name, level, fallback=False)

    @property
    def fallback_failure(self) -> str | None:
        """Why the fallback engine failed for good (its ``failure`` line, engine_health.py), or None while it serves."""
        failure = getattr(self.fallback, "failure", None)
        return failure if isinstance(failure, str) else None

    async def admit_batch(self, route: Route, *, draining: Callable[[], bool],
                          client_gone: Callable[[], Awaitable[object]] | None = None) -> None:
        """At level ≥ 1 a batch request for the primary waits while requests wait in its queue or the running
        batch is at the policy's cap; it is never dropped (it goes in once there is room, or the drain ends it). Held
        requests are waiting ones: past the primary's ``max_waiting`` (held ones and its queue together) the request
        is refused (QueueFullError, a 429) as the engine's full queue refuses it, and a held request whose client
        left (``client_gone`` returned) ends at once (ClientGone), not when the gate would have let it in."""
        if route.fallback:
            return
        held, watch = False, None
        try:
            while self.controller.level >= Level.PROTECT_REALTIME and not draining():
                self._batch_running = {h for h in self._batch_running if not h.finished}
                waiting = 0
                try:
                    waiting = int(getattr(self.primary.stats(), "waiting", 0) or 0)
                except Exception:  # noqa: BLE001
                    waiting = 0
                if waiting == 0 and len(self._batch_running) < self.policy.batch_running_cap:
                    break
                if not held:
                    bound = getattr(self.primary, "max_waiting", None)
                    if isinstance(bound, int) and self.held + waiting >= bound:
                        raise QueueFullError(f"{bound} requests are already waiting (batch requests held at SLO "
                                             f"level {int(self.controller.level)} included); retry later")
                    self.metrics.batch_held.inc()
                    self.held += 1
                    held = True
                    if client_gone is not None:
                        watch = asyncio.ensure_future(client_gone())
                pause = min(self.policy.tick_s, 0.02)
                if watch is None:
                    await asyncio.sleep(pause)
                elif (await asyncio.wait({watch}, timeout=pause))[0]:
                    raise ClientGone("the client disconnected while its batch request was held")
        finally:
            if held:
                self.held -= 1
            if watch is not None:
                watch.cancel()

    def admitted(self, handle: RequestHandle, mode: Mode, *, fallback: bool) -> None:
        """A batch request went into the primary: it counts toward the level-1 cap until it finishes."""
        if mode == Mode.BATCH and not fallback:
            self._batch_running.add(handle)

    # ---- what finished requests tell the signals -------------------------------------------------------
    def observe(self, record: RequestRecord) -> None:
        """A finished request: the signals hear of the primary's only (the ladder protects the primary: a slow
        fallback's latency would hold level 2 while the primary idles, and batch work sent to a busy fallback at
        level 1 would push every request onto it); the on-time and timeout counters count every request."""
        if record.outcome == "cached" or (record.outcome == "cancelled" and record.first_token is None):
            return  # an answer from the cache, or a client that left, says nothing about the engine's latency
        if not record.extra.get("slo_fallback"):
            self.signals.observe(ttft_s=record.ttft_s, queue_s=record.queue_s)
        if record.outcome == FinishReason.TIMEOUT and record.first_token is None:
            self.metrics.first_token_timeouts.inc()
        if record.outcome == "invalid":
            return  # the client's own grammar ended it mid-generation: not late, not on time (its latency counted)
        on_time = record.outcome in (FinishReason.STOP, FinishReason.LENGTH)
        self.metrics.finished.labels(record.mode, "true" if on_time else "false").inc()

    # ---- the response cache (level 2) ---------------------------------------------------------------------
    def cached(self, key: Any) -> dict[str, Any] | None:
        body = self.cache.get(key)
        self.metrics.cache.labels("hit" if body is not None else "miss").inc()
        return body

    def status(self) -> SloStatus:
        signals: Signals = self.signals.last
        controller = self.controller
        return SloStatus(level=int(controller.level), reason=controller.reason.value,
                         since_s=round(self.clock() - controller.since, 3),
                         recover_after_s=controller.recover_after_s, fallback=self.fallback_name,
                         fallback_failure=self.fallback_failure,
                         ttft_p90_s=signals.ttft_p90_s, queue_wait_p90_s=signals.queue_wait_p90_s,
                         kv_usage=signals.kv_usage, memory_ratio=signals.memory_ratio, gpu_load=signals.gpu_load)


__all__ = ["ClientGone", "Level", "Reason", "Route", "SloGuard"]
