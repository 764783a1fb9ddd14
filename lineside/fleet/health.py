"""Ask a node how it is: readiness, the model it serves, its load and degradation level (if it reports one).

Works for lineside nodes and for foreign OpenAI-compatible servers: lineside, vLLM and SGLang load gauges
are read from /metrics by name; a server without /metrics simply reports no load.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lineside.fleet.spec import Node

# (running, waiting) gauges by engine, first match wins
LOAD_GAUGES = (
    ("lineside_num_requests_running", "lineside_num_requests_waiting"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
)
DEGRADATION_GAUGES = ("lineside_degradation_level", "lineside_slo_level")
DEGRADATION_KEYS = ("degradation", "degradation_level", "slo_level")


@dataclass
class NodeHealth:
    node: str
    url: str
    reachable: bool
    ready: bool
    status: str  # ready | loading | draining | failed | unreachable | http <code>
    model: str | None = None
    degradation: str | None = None
    running: float | None = None
    waiting: float | None = None
    version: str | None = None  # the bundle version its target's `current` points at
    latency_ms: float | None = None
    error: str | None = None
    unauthorized: bool = False  # /metrics or /v1/models answered 401 (fleet status --api-key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe(node: Node, client: httpx.Client, *, with_details: bool = True) -> NodeHealth:
    """Readiness from ``node.health_path``; with details also /health, /metrics and /v1/models."""
    base = node.url.rstrip("/")
    t0 = time.perf_counter()
    try:
        r = client.get(base + node.health_path)
    except httpx.HTTPError as e:
        return NodeHealth(node.name, node.url, False, False, "unreachable", error=_short(e))
    ms = (time.perf_counter() - t0) * 1000
    body = _json(r)
    status = str(body.get("status") or ("ready" if r.status_code == 200 else f"http {r.status_code}"))
    h = NodeHealth(node.name, node.url, True, r.status_code == 200, status, latency_ms=round(ms, 2))
    if r.status_code != 200:
        h.error = str(body.get("reason") or body.get("status") or r.text[:120] or f"HTTP {r.status_code}")
    if not with_details:
        return h
    h.degradation = _degradation(body)
    if h.degradation is None and node.health_path != "/health":
        h.degradation = _degradation(_json(_get(client, base + "/health")))
    metrics = _get(client, base + "/metrics")
    if metrics is not None and metrics.status_code == 200:
        h.running, h.waiting, level = _load(metrics.text)
        h.degradation = h.degradation or level
    listed = _get(client, base + "/v1/models")
    refused = [path for path, r in (("/metrics", metrics), ("/v1/models", listed))
               if r is not None and r.status_code == 401]
    if refused:  # a node run with `serve --api-key`: its load and model are behind the key
        h.unauthorized = True
        h.error = h.error or f"{' and '.join(refused)} answered 401: the node wants an API key"
    models = _json(listed)
    data = models.get("data") if isinstance(models.get("data"), list) else []
    if data and isinstance(data[0], dict):
        h.model = data[0].get("id")
    return h


def _get(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        return client.get(url)
    except httpx.HTTPError:
        return None


def _json(r: httpx.Response | None) -> dict[str, Any]:
    if r is None:
        return {}
    try:
        d = r.json()
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def _degradation(body: dict[str, Any]) -> str | None:
    for k in DEGRADATION_KEYS:
        if body.get(k) is not None:
            return str(body[k])
    return None


def _load(text: str) -> tuple[float | None, float | None, str | None]:
    """(running, waiting, degradation level) from a Prometheus text exposition."""
    values: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                values[s.name] = values.get(s.name, 0.0) + float(s.value)
    except ValueError:
        return None, None, None
    running = waiting = None
    for r_name, w_name in LOAD_GAUGES:
        if r_name in values:
            running, waiting = values[r_name], values.get(w_name)
            break
    level = next((f"{values[g]:g}" for g in DEGRADATION_GAUGES if g in values), None)
    return running, waiting, level


def _short(e: Exception) -> str:
    msg = str(e) or type(e).__name__
    return msg.splitlines()[0][:160]


# Probes in a row that answer "failed" (a lineside node whose bundle did not load or whose engine failed) that end
# the wait at once: such a process does not recover by waiting. Two, not one: a restart hook that returns before the
# old process has gone may let it answer once more.
FAILED_PROBES = 2


def wait_healthy(node: Node, client: httpx.Client, timeout_s: float, *, interval_s: float = 1.0,
                 clock: Any = time.monotonic, sleep: Any = time.sleep) -> NodeHealth:
    """Poll readiness until ready, ``timeout_s`` passes, or the node says it failed ``FAILED_PROBES`` times in a row
    (clock and sleep are injectable for tests)."""
    deadline = clock() + timeout_s
    failed = 0
    while True:
        h = probe(node, client, with_details=False)
        failed = failed + 1 if h.status == "failed" else 0
        if h.ready or failed >= FAILED_PROBES or clock() >= deadline:
            return h
        sleep(interval_s)


def bundle_version(node: Node, ssh: str) -> str | None:
    """The version directory the node's target `current` points at (None without a target or a current)."""
    if not node.target:
        return None
    from lineside.errors import LinesideError
    from lineside.jetson.targets import open_target

    try:
        t = open_target(node.target, ssh)
        try:
            current, _ = t.links()
        finally:
            t.close()
    except (LinesideError, OSError):
        return None
    return current.removeprefix("versions/") if current else None
