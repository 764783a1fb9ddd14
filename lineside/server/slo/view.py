"""SloStatus / SloView: the level and the signals as a typed value, for a gateway or another process.

In-process, ``SloGuard.status()``; from elsewhere, ``SloView(base_url).read()`` reads the server's /health.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SloStatus:
    level: int
    reason: str
    since_s: float
    recover_after_s: float
    fallback: str | None
    ttft_p90_s: float | None
    queue_wait_p90_s: float | None
    kv_usage: float | None
    memory_ratio: float | None
    gpu_load: float | None
    fallback_failure: str | None = None  # why the fallback failed for good (requests then stay on the primary)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SloStatus:
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


class SloView:
    """Reads a running server's SLO status over HTTP (GET /health, which needs no API key)."""

    def __init__(self, base_url: str, *, timeout: float = 2.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def read(self) -> SloStatus | None:
        """The server's status; None when it runs without an SLO guard."""
        import httpx

        response = httpx.get(self.base_url + "/health", timeout=self.timeout)
        response.raise_for_status()
        slo = response.json().get("slo")
        return None if slo is None else SloStatus.from_json(slo)
