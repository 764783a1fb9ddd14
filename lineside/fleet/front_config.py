"""The front's settings, apart from the front itself: `fleet gateway --dry-run` writes them without the
front's runtime dependencies (aiohttp, the fleet extra) being installed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShadowSpec:
    source: str
    candidate: str
    share: float
    max_in_flight: int = 32  # copies beyond this are dropped (counted), never queued behind clients


@dataclass(frozen=True)
class FrontConfig:
    pools: dict[str, str]  # pool → its SMG router's base URL
    default_pool: str
    session_header: str = "x-session-id"
    session_cookie: str = "lineside_session"
    session_idle_s: int = 300
    issue_cookie: bool = True
    priority: bool = True  # X-Priority → SMG's X-SMG-Priority and the nodes' tracestate / body priority
    shadow: ShadowSpec | None = None
    request_timeout_s: float = 600.0
    body_priority_pools: frozenset[str] = frozenset()  # pools with vLLM/SGLang members: priority in the body
