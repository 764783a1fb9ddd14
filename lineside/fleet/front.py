"""The thin front of the gateway: what SMG cannot do, in front of one SMG router per pool.

SMG (one process per pool) does the routing policy, health checks, circuit breakers, retries and metrics.
The front (served by lineside.fleet.passthrough, an HTTP/1.1 relay at the asyncio Protocol level) adds only:
- header → pool: ``X-Mode: realtime|batch|<pool>`` (``X-Batch: true`` means batch), default pool otherwise;
- sessions: the ``X-Session-Id`` header or the session cookie becomes SMG's routing key (SMG keeps the key on
  one worker for ``--sticky-key-idle-secs``); a request with neither gets a new id and a cookie;
- the request's class to the nodes: SMG forwards no X-Priority / X-Mode, so the front writes them into the
  ``tracestate`` header (which SMG forwards; `lineside serve` reads it) and, for pools with vLLM/SGLang
  members, into the body's ``priority`` (their own field); X-Priority also becomes SMG's admission class;
- shadow traffic: a share of one pool's requests is copied to a candidate pool in the background; the copy's
  response is read and discarded, its latency and its agreement with the primary's answer are recorded.
Bodies and responses pass through byte for byte, except the ``priority`` field above.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import cookie_parser

from lineside.fleet.front_config import FrontConfig
from lineside.fleet.passthrough import (
    REQUEST_DROP,
    Answer,
    Forward,
    RawHeaders,
    RequestHead,
    UpstreamPool,
    error_answer,
    serve,
)
from lineside.fleet.relay import Upstream, UpstreamError
from lineside.request_class import tracestate_member, with_member

SHADOW_HEADER = "x-lineside-shadow"
# lineside's X-Priority values → SMG's admission classes (middleware/scheduler/class.rs: X-SMG-Priority)
SMG_PRIORITY = {"high": "interactive", "normal": "default", "low": "bulk"}
NOT_FOUND = frozenset({404})  # the router's answers the front looks at before passing them on
NODE_MODES = ("realtime", "batch")  # the pools whose name is also the nodes' X-Mode
# vLLM's / SGLang's body ``priority`` (lower is served first; SGLang with --schedule-low-priority-values-first):
# lineside's order — every realtime level before any batch one
_BODY_RANK = {"high": -1, "normal": 0, "low": 1}
_BATCH_OFFSET = 10


def body_priority(priority: str | None, mode: str | None) -> int:
    return _BODY_RANK[priority or "normal"] + (_BATCH_OFFSET if mode == "batch" else 0)


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


def _error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI-shaped error body (None when it is not one)."""
    try:
        d = json.loads(body)
    except ValueError:
        return None
    err = d.get("error") if isinstance(d, dict) else None
    return str(err.get("code")) if isinstance(err, dict) else None


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
    """The front's decisions per request (``decide``, called by the passthrough server) and the state it owns:
    upstream connections, the shadow sampler, the shadow stats, the metrics."""

    def __init__(self, cfg: FrontConfig) -> None:
        self.cfg = cfg
        self.metrics = _Metrics()
        self.shadow_stats = ShadowStats()
        self._sampler = ShareSampler(cfg.shadow.share) if cfg.shadow else None
        self._shadow_slots = asyncio.Semaphore(cfg.shadow.max_in_flight) if cfg.shadow else None
        self._shadow_tasks: set[asyncio.Task[None]] = set()
        self.pool = UpstreamPool(cfg.request_timeout_s)  # the proxy path
        self.upstream = Upstream(cfg.request_timeout_s)  # shadow copies and health checks (off the hot path)
        self._session_header = cfg.session_header.lower().encode()
        self._counted: dict[tuple[str, str], Any] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}

    async def serve(self, host: str, port: int) -> asyncio.Server:
        return await serve(self.decide, self.pool, host=host, port=port)

    async def aclose(self) -> None:
        for t in list(self._shadow_tasks):
            t.cancel()
        self.pool.close()
        await self.upstream.aclose()

    def _count(self, pool: str, status: str) -> None:
        c = self._counted.get((pool, status))
        if c is None:
            c = self._counted[(pool, status)] = self.metrics.requests.labels(pool, status)
        c.inc()

    def _target(self, url: str) -> tuple[str, int, bytes]:
        t = self._targets.get(url)
        if t is None:
            u = urlsplit(url)
            t = self._targets[url] = (u.hostname or "127.0.0.1", u.port or 80, u.path.rstrip("/").encode())
        return t

    # ----- routing -----

    def pool_for(self, mode: str, batch: str) -> str | None:
        """The pool a request goes to; None when X-Mode names no pool."""
        if not mode and batch in ("1", "true", "yes"):
            mode = "batch"
        if not mode:
            return self.cfg.default_pool
        return mode if mode in self.cfg.pools else None

    def session_for(self, header: str | None, cookie: str | None) -> tuple[str, bool]:
        """(session id, whether it is new) from the session header, else the session cookie."""
        sid = header
        if not sid and cookie:
            sid = cookie_parser(cookie).get(self.cfg.session_cookie)
        if sid and 0 < len(sid) <= 128 and sid.isascii() and sid.isprintable():
            return sid, False
        return secrets.token_hex(16), True

    # ----- the proxy path -----

    def decide(self, head: RequestHead) -> Forward | Answer | asyncio.Future[Answer]:
        """Where one request goes and what changes on the way, or the answer the front gives itself."""
        if head.path.startswith("/fleet/"):
            return self._own(head)
        mode = batch = pr = ""
        session = cookie = trace = None
        headers: RawHeaders = []
        sh = self._session_header
        for k, v in head.headers:  # one pass: pick what the front reads, keep what goes on
            if k == b"x-mode":
                mode = v.decode("latin-1").strip().lower()
            elif k == b"x-batch":
                batch = v.decode("latin-1").strip().lower()
            elif k == b"x-priority":
                pr = v.decode("latin-1").strip().lower()
            elif k == sh:
                session = v.decode("latin-1")
                continue
            elif k == b"cookie":
                cookie = v.decode("latin-1")
            elif k == b"tracestate":
                trace = v.decode("latin-1")
                continue
            elif k == b"x-smg-priority" or k in REQUEST_DROP:  # no self-promotion past the front
                continue
            headers.append((k, v))
        pool = self.pool_for(mode, batch)
        if pool is None:
            self._count("-", "4xx")
            return error_answer(
                400, f"X-Mode {mode!r} is not a pool of this gateway; use one of: {', '.join(self.cfg.pools)}",
                "unknown_pool", param="X-Mode")
        if pr and pr not in SMG_PRIORITY:
            self._count(pool, "4xx")
            return error_answer(400, f"X-Priority {pr!r} is not one of {', '.join(SMG_PRIORITY)}", "invalid_priority",
                                param="X-Priority")
        sid, new = self.session_for(session, cookie)
        keyed = not new or self.cfg.issue_cookie
        if keyed:
            headers.append((sh, sid.encode()))
        node_mode = pool if pool in NODE_MODES else None
        carried = pr if pr and self.cfg.priority else None
        ts = with_member(trace, tracestate_member(priority=carried, mode=node_mode))
        if ts:
            headers.append((b"tracestate", ts.encode("latin-1")))
        if pr and self.cfg.priority:
            headers.append((b"x-smg-priority", SMG_PRIORITY[pr].encode()))
        rewrite = None
        if pool in self.cfg.body_priority_pools and (carried or node_mode == "batch"):
            value = body_priority(carried, node_mode)
            rewrite = lambda b: _with_body_priority(b, value)  # noqa: E731
        shadow = (self.cfg.shadow is not None and pool == self.cfg.shadow.source and head.method == "POST"
                  and head.path.startswith("/v1/") and self._sampler is not None and self._sampler())
        extra = []
        if new and keyed and self.cfg.issue_cookie:
            extra.append((b"set-cookie", (f"{self.cfg.session_cookie}={sid}; Max-Age={self.cfg.session_idle_s}; "
                                          "Path=/; HttpOnly; SameSite=Lax").encode()))
        host, port, prefix = self._target(self.cfg.pools[pool])

        def done(status: int, ctype: bytes, kept: bytes | None, seconds: float, sent: bytes) -> None:
            self._count(pool, f"{status // 100}xx")
            if kept is not None and status == 200:
                text = sse_text([kept]) if ctype.startswith(b"text/event-stream") else answer_text(kept)
                self._start_shadow(head.path, headers, sent, text, seconds)

        def unreachable(why: str) -> Answer:
            self.metrics.upstream_errors.labels(pool).inc()
            self._count(pool, "5xx")
            return error_answer(502, f"the {pool!r} pool's router is unreachable ({why}); check `lineside fleet status`",
                                "pool_unreachable", kind="server_error")

        async def replace(status: int, body: bytes) -> Answer | None:
            a = await self._no_node_answer(pool, body)
            if a is not None:
                a.headers.extend(extra)
            return a

        return Forward(host, port, headers, prefix=prefix, body=rewrite, add_response=extra, keep_body=shadow,
                       done=done, unreachable=unreachable, replace_statuses=NOT_FOUND, replace=replace)

    async def _no_node_answer(self, pool: str, body: bytes) -> Answer | None:
        """SMG answers 404 ``model_not_found`` for a model no node serves and, alike, while no node of its pool has
        registered (none answered its health check since the router started): that one is an outage, a 503 an
        OpenAI client retries, not a wrong model name it would give up on. None: the router's answer stands."""
        if _error_code(body) != "model_not_found" or await self._router_ready(self.cfg.pools[pool]):
            return None
        return error_answer(503, f"no node of pool {pool!r} is ready (none has passed its health check since the "
                            "gateway started, or all are down); retry later, and see `lineside fleet status`",
                            "no_ready_node", kind="server_error")

    async def _router_ready(self, url: str) -> bool:
        """Whether a pool's router has a healthy node: SMG's /readiness (its /health is only its own liveness)."""
        try:
            return (await self.upstream.read("GET", url + "/readiness", [], b"", timeout_s=3.0))[0] == 200
        except UpstreamError:
            return False

    # ----- shadow -----

    def _start_shadow(self, path: str, headers: RawHeaders, body: bytes, primary_text: str,
                      primary_s: float) -> None:
        spec = self.cfg.shadow
        assert spec is not None and self._shadow_slots is not None
        if self._shadow_slots.locked():
            self.shadow_stats.dropped += 1
            self.metrics.shadow.labels(spec.source, spec.candidate, "dropped").inc()
            return
        url = self.cfg.pools[spec.candidate] + path
        copy_headers = [(k, v) for k, v in headers if k not in (b"x-smg-priority", b"cookie")]
        task = asyncio.get_running_loop().create_task(
            self._shadow(url, [*copy_headers, (SHADOW_HEADER.encode(), b"1")], body, primary_text, primary_s))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow(self, url: str, headers: RawHeaders, body: bytes, primary_text: str,
                      primary_s: float) -> None:
        spec = self.cfg.shadow
        assert spec is not None and self._shadow_slots is not None
        st, m = self.shadow_stats, self.metrics
        async with self._shadow_slots:
            st.sent += 1
            t0 = time.perf_counter()
            try:
                status, ctype, answer = await self.upstream.read("POST", url, headers, body)
                ok, streaming = status == 200, ctype.startswith("text/event-stream")
            except Exception:  # noqa: BLE001 - a shadow copy never affects anything but its own counters
                ok, answer, streaming = False, b"", False
            dt = time.perf_counter() - t0
            if not ok:
                st.failed += 1
                m.shadow.labels(spec.source, spec.candidate, "error").inc()
                return
            text = sse_text([answer]) if streaming else answer_text(answer)
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

    def _own(self, head: RequestHead) -> Answer | asyncio.Future[Answer]:
        if head.method != "GET":
            return error_answer(405, f"{head.path} takes GET", "method_not_allowed")
        if head.path == "/fleet/shadow":
            d = self.shadow_stats.to_dict()
            d["in_flight"] = len(self._shadow_tasks)
            d["config"] = None if self.cfg.shadow is None else vars(self.cfg.shadow)
            return _json_answer(200, d)
        if head.path == "/fleet/metrics":
            return Answer(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST.encode())
        if head.path == "/fleet/health":
            return asyncio.ensure_future(self.health())
        return error_answer(404, f"no {head.path} here: the front serves /fleet/shadow, /fleet/metrics, "
                            "/fleet/health and passes everything else to a pool", "not_found")

    async def health(self) -> Answer:
        """Each pool: whether its router can serve, i.e. has a healthy node. SMG's /health is the router's own
        liveness (200 with every worker down); its /readiness is 503 until a worker of the pool is healthy."""
        names = list(self.cfg.pools)
        oks = await asyncio.gather(*(self._router_ready(self.cfg.pools[p]) for p in names))
        pools = dict(zip(names, oks, strict=True))
        return _json_answer(200 if any(oks) else 503, {"status": "ok" if all(oks) else "degraded", "pools": pools})


def _json_answer(status: int, payload: dict[str, Any]) -> Answer:
    return Answer(status, json.dumps(payload).encode())


def _with_body_priority(body: bytes, value: int) -> bytes:
    """The JSON body with ``priority`` set (vLLM's / SGLang's field), unless the client set one itself or the
    body is not a JSON object (then it passes unchanged and the node answers for it)."""
    try:
        d = json.loads(body)
    except ValueError:
        return body
    if not isinstance(d, dict) or "priority" in d:
        return body
    d["priority"] = value
    return json.dumps(d, separators=(",", ":")).encode()
