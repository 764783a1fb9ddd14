"""Rolling signals the controller decides by: TTFT and queue-wait P90 over a time window (from finished
requests), KV usage (the engine's stats), device memory and GPU load (NVML or Jetson, where present).

Samples carry the time of an injected clock, so tests move the window without sleeping.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Signals:
    """One reading; None where the signal is not known (no samples, no device reader)."""

    ttft_p90_s: float | None = None
    queue_wait_p90_s: float | None = None
    kv_usage: float | None = None
    memory_ratio: float | None = None
    gpu_load: float | None = None
    ttft_samples: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RollingWindow:
    """(time, value) samples kept for ``window_s`` seconds; its P90 needs ``min_samples``."""

    def __init__(self, window_s: float, min_samples: int = 1):
        self.window_s = window_s
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def count(self, now: float) -> int:
        self._trim(now)
        return len(self._samples)

    def p90(self, now: float) -> float | None:
        self._trim(now)
        if len(self._samples) < self.min_samples:
            return None
        return float(np.quantile([v for _, v in self._samples], 0.9))


def device_reading(health: dict[str, Any]) -> tuple[float | None, float | None]:
    """(memory used ratio, GPU load 0..1) from lineside.jetson.gpu_health's answer; None where not reported.
    NVML: the busiest device; Jetson: unified memory (total - available) / total."""
    if not health.get("gpu"):
        return None, None
    memory = load = None
    devices = health.get("devices")
    if devices:
        ratios = [d["memory_used_bytes"] / d["memory_total_bytes"] for d in devices if d.get("memory_total_bytes")]
        loads = [d["gpu_load_percent"] / 100.0 for d in devices if d.get("gpu_load_percent") is not None]
        memory = max(ratios) if ratios else None
        load = max(loads) if loads else None
    else:
        total, available = health.get("memory_total_bytes"), health.get("memory_available_bytes")
        if total and available is not None:
            memory = (total - available) / total
        if health.get("gpu_load_percent") is not None:
            load = float(health["gpu_load_percent"]) / 100.0
    return memory, load


def read_device() -> tuple[float | None, float | None]:
    """The device's (memory ratio, GPU load) now; (None, None) without a GPU reader."""
    try:
        from lineside.jetson.gpu_health import gpu_health

        return device_reading(gpu_health())
    except Exception:  # noqa: BLE001 - a missing or failing device reader means "unknown", not an outage
        return None, None


class SignalSource:
    """Collects request samples as they finish and reads the gauges at each controller tick."""

    def __init__(self, *, window_s: float, min_samples: int, clock: Callable[[], float],
                 device: Callable[[], tuple[float | None, float | None]] = read_device):
        self.clock = clock
        self.device = device
        self.ttft = RollingWindow(window_s, min_samples)
        self.queue_wait = RollingWindow(window_s, min_samples)
        self.last = Signals()

    def observe(self, *, ttft_s: float | None, queue_s: float | None) -> None:
        now = self.clock()
        if ttft_s is not None:
            self.ttft.add(now, ttft_s)
        if queue_s is not None:
            self.queue_wait.add(now, queue_s)

    def read(self, engine_stats: Any = None) -> Signals:
        """The current reading (device reader included: call it off the event loop on a real device)."""
        now = self.clock()
        kv = None
        if engine_stats is not None:
            kv = getattr(engine_stats, "kv_usage", None)
            if kv is None and isinstance(engine_stats, dict):
                kv = engine_stats.get("kv_usage")
        memory, load = self.device()
        self.last = Signals(ttft_p90_s=self.ttft.p90(now), queue_wait_p90_s=self.queue_wait.p90(now),
                            kv_usage=None if kv is None else float(kv), memory_ratio=memory, gpu_load=load,
                            ttft_samples=self.ttft.count(now))
        return self.last
