"""The degradation ladder: escalate at once when a level's threshold is crossed, recover one level at a time
after the signals stayed below for ``recover_after_s``, and lengthen that delay on flapping.

Pure logic: ``evaluate(signals, now, local_time)`` with times the caller gives, so tests drive it with a fake
clock. It runs in the server's controller task, never in the engine's step loop.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from lineside.server.slo.policy import SIGNAL_NAMES, SloPolicy, Thresholds
from lineside.server.slo.signals import Signals
from lineside.strenum import StrEnum


class Level(IntEnum):
    NORMAL = 0
    PROTECT_REALTIME = 1  # batch held back and capped; named traffic to the fallback
    FALLBACK = 2  # new requests to the fallback; exact repeats from the cache


class Reason(StrEnum):
    """Why the level is what it is (a transition's label in /metrics)."""

    NORMAL = "normal"
    TTFT_P90 = "ttft_p90_s"
    QUEUE_WAIT_P90 = "queue_wait_p90_s"
    KV_USAGE = "kv_usage"
    MEMORY = "memory_ratio"
    GPU_LOAD = "gpu_load"
    PINNED = "pinned"
    RECOVERED = "recovered"


@dataclass(frozen=True)
class Transition:
    at: float
    old: Level
    new: Level
    reason: Reason


def breached(thresholds: Thresholds, signals: Signals) -> Reason | None:
    """The first signal above its threshold (policy order), or None."""
    for name in SIGNAL_NAMES:
        limit, value = getattr(thresholds, name), getattr(signals, name)
        if limit is not None and value is not None and value > limit:
            return Reason(name)
    return None


class SloController:
    """Owns the level. ``on_transition`` is told of every change (metrics, log)."""

    def __init__(self, policy: SloPolicy, *, now: float,
                 on_transition: Callable[[Transition], None] | None = None):
        self.policy = policy
        self.level = Level.NORMAL
        self.reason = Reason.NORMAL
        self.since = now
        self.recover_after_s = policy.recover_after_s  # grows on flaps, back to the policy's once stable
        self.on_transition = on_transition
        self._calm_since: float | None = None  # when the signals last went below the current level's need
        self._last_recovery: float | None = None
        self.history: list[Transition] = []

    def target(self, signals: Signals, local_time: dt.time) -> tuple[Level, Reason]:
        """The level the signals (and pins) ask for right now: the higher of the two (a pin is a floor, also
        above a level the signals ask for)."""
        want, reason = Level.NORMAL, Reason.NORMAL
        for level, thresholds in ((Level.FALLBACK, self.policy.level_2), (Level.PROTECT_REALTIME, self.policy.level_1)):
            crossed = breached(thresholds, signals)
            if crossed is not None:
                want, reason = level, crossed
                break
        pinned = self.policy.pinned_level(local_time)
        if pinned > want:
            return Level(pinned), Reason.PINNED
        return want, reason

    def evaluate(self, signals: Signals, *, now: float, local_time: dt.time) -> Level:
        """One controller step; returns the (possibly new) level."""
        want, reason = self.target(signals, local_time)
        pinned = Level(self.policy.pinned_level(local_time))
        if want > self.level:
            flapped = self._last_recovery is not None and now - self._last_recovery < self.policy.flap_window_s
            if flapped:
                # from one tick at least: a recover_after_s of 0 times the factor stays 0 and flaps every tick
                self.recover_after_s = min(max(self.recover_after_s, self.policy.tick_s) * self.policy.backoff_factor,
                                           self.policy.max_recover_after_s)
            self._move(want, reason, now)
            self._calm_since = None
        elif want == self.level:
            self._calm_since = None
            if reason != self.reason and self.level > Level.NORMAL:
                self.reason = reason  # same level, a different cause now: /health says the current one
        else:
            if pinned >= self.level:
                self._calm_since = None
                self.reason = Reason.PINNED
            elif self._calm_since is None:
                self._calm_since = now
            if self._calm_since is not None and now - self._calm_since >= self.recover_after_s:
                self._move(Level(self.level - 1), Reason.RECOVERED, now)
                self._last_recovery = now
                self._calm_since = now if want < self.level else None  # the next step down waits again
        if (self.level == Level.NORMAL and self._last_recovery is not None
                and now - self._last_recovery >= self.policy.flap_window_s):
            self.recover_after_s = self.policy.recover_after_s  # stable again: forget the flaps
        return self.level

    def _move(self, new: Level, reason: Reason, now: float) -> None:
        transition = Transition(now, self.level, new, reason)
        self.level, self.reason, self.since = new, reason, now
        self.history.append(transition)
        del self.history[:-64]
        if self.on_transition is not None:
            self.on_transition(transition)
