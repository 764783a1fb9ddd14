"""The thin front of the gateway: what SMG cannot do, in front of one SMG router per pool.

SMG (one process per pool) does the routing policy, health checks, circuit breakers, retries and metrics.
This ASGI app adds only:
- header → pool: ``X-Mode: realtime|batch|<pool>`` (``X-Batch: true`` means batch), default pool otherwise;
- sessions: the ``X-Session-Id`` header or the session cookie becomes SMG's routing key (SMG keeps the key on
  one worker for ``--sticky-key-idle-secs``); a request with neither gets a new id and a cookie;
- shadow traffic: a share of one pool's requests is copied to a candidate pool in the background; the copy's
  response is read and discarded, its latency and its agreement with the primary's answer are recorded.
Requests are streamed through unchanged (X-Priority and the SLO headers reach the nodes as sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "host", "content-length"})
SHADOW_HEADER = "x-lineside-shadow"
# lineside's X-Priority values → SMG's admission classes (middleware/scheduler/class.rs: X-SMG-Priority)
SMG_PRIORITY = {"high": "interactive", "normal": "default", "low": "bulk"}


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
    priority: bool = True  # map X-Priority onto SMG's X-SMG-Priority
    shadow: ShadowSpec | None = None
    request_timeout_s: float = 600.0


def _error(status: int, message: str, code: str, param: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": param}},
                        status_code=status)


class ShareSampler:
    """Deterministic: of every n requests, round(n × share) are picked, evenly spread (no RNG to seed)."""

    def __init__(self, share: float) -> None:
        self.share = share
        self._n = 0
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            before = int(self._n * self.share)
            self._n += 1
            return int(self._n * self.share) > before


@dataclass
class ShadowStats:
    """What the shadow copies did (kept here as well as in Prometheus, for `fleet status` and tests)."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    dropped: int = 0
    agreed: int = 0
    similarity_sum: float = 0.0
    primary_s: list[float] = field(default_factory=list)
    candidate_s: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        def med(v: list[float]) -> float | None:
            return sorted(v)[len(v) // 2] if v else None

        return {"sent": self.sent, "completed": self.completed, "failed": self.failed, "dropped": self.dropped,
                "agreed": self.agreed,
                "agreement": self.agreed / self.completed if self.completed else None,
                "mean_similarity": self.similarity_sum / self.completed if self.completed else None,
                "median_primary_s": med(self.primary_s), "median_candidate_s": med(self.candidate_s)}


class _Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lineside_fleet_requests_total", "Requests by pool and status class",
                                ["pool", "status"], registry=r)
        self.upstream_errors = Counter("lineside_fleet_upstream_errors_total", "Pool router unreachable",
                                       ["pool"], registry=r)
        self.shadow = Counter("lineside_fleet_shadow_requests_total", "Shadow copies by result",
                              ["source", "candidate", "result"], registry=r)
        self.shadow_agree = Counter("lineside_fleet_shadow_agreements_total",
                                    "Shadow copies whose answer equals the primary's", ["source", "candidate"],
                                    registry=r)
        self.shadow_similarity = Histogram("lineside_fleet_shadow_similarity",
                                           "Similarity of the shadow answer to the primary's (0..1)",
                                           ["source", "candidate"], registry=r,
                                           buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0))
        self.shadow_latency = Histogram("lineside_fleet_shadow_latency_seconds",
                                        "End-to-end latency of shadowed requests", ["pool", "role"], registry=r)


def answer_text(body: bytes) -> str:
    """The generated text of a non-streaming chat/completions response (empty when it is not one)."""
    try:
        d = json.loads(body)
    except ValueError:
        return ""
    out = []
    for c in d.get("choices") or [] if isinstance(d, dict) else []:
        msg = c.get("message") or {}
        out.append(str(msg.get("content") or c.get("text") or ""))
    return "".join(out)


def sse_text(chunks: list[bytes]) -> str:
    """The generated text carried by an SSE stream of chat/completions chunks."""
    out = []
    for line in b"".join(chunks).split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            d = json.loads(data)
        except ValueError:
            continue
        for c in d.get("choices") or []:
            delta = c.get("delta") or {}
            out.append(str(delta.get("content") or c.get("text") or ""))
    return "".join(out)


class Front:
    """The ASGI app and the state it owns (the upstream client, the sampler, the shadow stats)."""

    def __init__(self, cfg: FrontConfig, client: httpx.AsyncClient | None = None) -> None:
        self.cfg = cfg
        self.metrics = _Metrics()
        self.shadow_stats = ShadowStats()
        self._sampler = ShareSampler(cfg.shadow.share) if cfg.shadow else None
        self._shadow_slots = asyncio.Semaphore(cfg.shadow.max_in_flight) if cfg.shadow else None
        self._shadow_tasks: set[asyncio.Task[None]] = set()
        self._own_client = client is None
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=512), trust_env=False)
        self.app = Starlette(routes=[
            Route("/fleet/shadow", self.shadow_summary, methods=["GET"]),
            Route("/fleet/metrics", self.prometheus, methods=["GET"]),
            Route("/fleet/health", self.health, methods=["GET"]),
            Route("/{path:path}", self.proxy, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.aclose()

    async def aclose(self) -> None:
        for t in list(self._shadow_tasks):
            t.cancel()
        if self._own_client:
            await self.client.aclose()

    # ----- routing -----

    def pool_for(self, request: Request) -> str | JSONResponse:
        mode = (request.headers.get("x-mode") or "").strip().lower()
        if not mode and (request.headers.get("x-batch") or "").strip().lower() in ("1", "true", "yes"):
            mode = "batch"
        if not mode:
            return self.cfg.default_pool
        if mode not in self.cfg.pools:
            return _error(400, f"X-Mode {mode!r} is not a pool of this gateway; use one of: "
                               f"{', '.join(self.cfg.pools)}", "unknown_pool", "X-Mode")
        return mode

    def session_for(self, request: Request) -> tuple[str, bool]:
        """(session id, whether it is new)."""
        sid = request.headers.get(self.cfg.session_header) or request.cookies.get(self.cfg.session_cookie)
        if sid and 0 < len(sid) <= 128 and sid.isascii() and sid.isprintable():
            return sid, False
        return secrets.token_hex(16), True

    # ----- handlers -----

    async def proxy(self, request: Request) -> Response:
        pool = self.pool_for(request)
        if isinstance(pool, JSONResponse):
            self.metrics.requests.labels("-", "4xx").inc()
            return pool
        pr = (request.headers.get("x-priority") or "").strip().lower()
        if pr and pr not in SMG_PRIORITY:
            self.metrics.requests.labels(pool, "4xx").inc()
            return _error(400, f"X-Priority {pr!r} is not one of {', '.join(SMG_PRIORITY)}", "invalid_priority",
                          "X-Priority")
        body = await request.body()
        sid, new = self.session_for(request)
        headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP
                   and k not in (self.cfg.session_header, "x-smg-priority")]  # no self-promotion past the front
        keyed = not new or self.cfg.issue_cookie
        if keyed:
            headers.append((self.cfg.session_header, sid))
        if pr and self.cfg.priority:
            headers.append(("x-smg-priority", SMG_PRIORITY[pr]))
        url = self.cfg.pools[pool] + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        shadow = (self.cfg.shadow is not None and pool == self.cfg.shadow.source and request.method == "POST"
                  and request.url.path.startswith("/v1/") and self._sampler is not None and self._sampler())
        t0 = time.perf_counter()
        req = self.client.build_request(request.method, url, headers=headers, content=body)
        try:
            up = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            self.metrics.upstream_errors.labels(pool).inc()
            self.metrics.requests.labels(pool, "5xx").inc()
            return _error(502, f"the {pool!r} pool's router is unreachable ({type(e).__name__}); "
                               "check `lineside fleet status`", "pool_unreachable", None, "server_error")
        self.metrics.requests.labels(pool, f"{up.status_code // 100}xx").inc()
        out_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP
                       and k.lower() != "content-encoding"}
        cookie = None
        if new and keyed and self.cfg.issue_cookie:
            cookie = (f"{self.cfg.session_cookie}={sid}; Max-Age={self.cfg.session_idle_s}; Path=/; HttpOnly; "
                      "SameSite=Lax")
        streaming = up.headers.get("content-type", "").startswith("text/event-stream")
        if not streaming:
            content = await up.aread()
            await up.aclose()
            resp = Response(content, status_code=up.status_code, headers=out_headers)
            if cookie:
                resp.headers.append("set-cookie", cookie)
            if shadow and up.status_code == 200:
                self._start_shadow(request, headers, body, answer_text(content), time.perf_counter() - t0)
            return resp
        seen: list[bytes] | None = [] if shadow else None

        async def relay() -> AsyncIterator[bytes]:
            async for chunk in up.aiter_raw():
                if seen is not None:
                    seen.append(chunk)
                yield chunk

        def finished() -> None:
            if seen is not None and up.status_code == 200:
                self._start_shadow(request, headers, body, sse_text(seen), time.perf_counter() - t0)

        async def close_and_shadow() -> None:
            await up.aclose()
            finished()

        resp = StreamingResponse(relay(), status_code=up.status_code, headers=out_headers,
                                 background=BackgroundTask(close_and_shadow))
        if cookie:
            resp.headers.append("set-cookie", cookie)
        return resp

    # ----- shadow -----

    def _start_shadow(self, request: Request, headers: list[tuple[str, str]], body: bytes, primary_text: str,
                      primary_s: float) -> None:
        spec = self.cfg.shadow
        assert spec is not None and self._shadow_slots is not None
        if self._shadow_slots.locked():
            self.shadow_stats.dropped += 1
            self.metrics.shadow.labels(spec.source, spec.candidate, "dropped").inc()
            return
        url = self.cfg.pools[spec.candidate] + request.url.path
        task = asyncio.get_running_loop().create_task(
            self._shadow(url, [*headers, (SHADOW_HEADER, "1")], body, primary_text, primary_s))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow(self, url: str, headers: list[tuple[str, str]], body: bytes, primary_text: str,
                      primary_s: float) -> None:
        spec = self.cfg.shadow
        assert spec is not None and self._shadow_slots is not None
        st, m = self.shadow_stats, self.metrics
        async with self._shadow_slots:
            st.sent += 1
            t0 = time.perf_counter()
            try:
                async with self.client.stream("POST", url, headers=headers, content=body) as r:
                    chunks = [c async for c in r.aiter_raw()]
                    ok = r.status_code == 200
                    streaming = r.headers.get("content-type", "").startswith("text/event-stream")
            except Exception:  # noqa: BLE001 - a shadow copy never affects anything but its own counters
                ok, chunks, streaming = False, [], False
            dt = time.perf_counter() - t0
            if not ok:
                st.failed += 1
                m.shadow.labels(spec.source, spec.candidate, "error").inc()
                return
            text = sse_text(chunks) if streaming else answer_text(b"".join(chunks))
            sim = difflib.SequenceMatcher(None, primary_text, text).ratio() if (primary_text or text) else 1.0
            st.completed += 1
            st.similarity_sum += sim
            st.primary_s.append(primary_s)
            st.candidate_s.append(dt)
            m.shadow.labels(spec.source, spec.candidate, "ok").inc()
            m.shadow_similarity.labels(spec.source, spec.candidate).observe(sim)
            m.shadow_latency.labels(spec.source, "primary").observe(primary_s)
            m.shadow_latency.labels(spec.candidate, "candidate").observe(dt)
            if text == primary_text:
                st.agreed += 1
                m.shadow_agree.labels(spec.source, spec.candidate).inc()

    async def drain_shadow(self) -> None:
        """Wait for the shadow copies in flight (tests, shutdown)."""
        while self._shadow_tasks:
            await asyncio.gather(*list(self._shadow_tasks), return_exceptions=True)

    # ----- own endpoints -----

    async def shadow_summary(self, request: Request) -> JSONResponse:
        d = self.shadow_stats.to_dict()
        d["in_flight"] = len(self._shadow_tasks)
        d["config"] = None if self.cfg.shadow is None else vars(self.cfg.shadow)
        return JSONResponse(d)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(self, request: Request) -> JSONResponse:
        async def one(url: str) -> bool:
            try:
                return (await self.client.get(url + "/health", timeout=3.0)).status_code == 200
            except httpx.HTTPError:
                return False

        names = list(self.cfg.pools)
        oks = await asyncio.gather(*(one(self.cfg.pools[p]) for p in names))
        pools = dict(zip(names, oks, strict=True))
        return JSONResponse({"status": "ok" if all(oks) else "degraded", "pools": pools},
                            status_code=200 if any(oks) else 503)
