"""A pass-through in front of a server that has no ``GET /health`` (llama-cpp-python's OpenAI server).

SMG registers an HTTP worker only after ``GET <url>/health`` answers 2xx: the path is fixed in its source
(model_gateway/src/workflow/steps/util.rs, ``http_health_url``), whatever ``--health-check-endpoint`` says, so
such a server never joins a pool. This adapter answers ``/health`` and ``/health/ready`` from the node's own
health path (``/v1/models`` works for any OpenAI server) and streams every other request through unchanged.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lineside.fleet.passthrough import error_body
from lineside.fleet.relay import (
    REQUEST_DROP,
    ClientGone,
    Receive,
    Scope,
    Send,
    Upstream,
    UpstreamError,
    lifespan,
    read_body,
    relay_response,
    send_json,
    target,
)


class HealthAdapter:
    """ASGI app (``adapter.app``): /health from ``upstream + health_path``, the rest passed through."""

    def __init__(self, upstream: str, health_path: str, timeout_s: float = 600.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.health_path = health_path
        self.relay = Upstream(timeout_s)
        self._health = Starlette(routes=[Route("/health", self.health, methods=["GET"]),
                                         Route("/health/ready", self.health, methods=["GET"])])
        self.app = self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["path"] in ("/health", "/health/ready"):
                await self._health(scope, receive, send)
            else:
                await self.proxy(scope, receive, send)
        elif scope["type"] == "lifespan":
            await lifespan(receive, send, self.relay.aclose)

    async def health(self, request: Request) -> JSONResponse:
        try:
            status = (await self.relay.read("GET", self.upstream + self.health_path, [], b"", timeout_s=5.0))[0]
        except UpstreamError as e:
            return JSONResponse({"status": "unreachable", "reason": type(e).__name__}, status_code=503)
        ok = status == 200
        return JSONResponse({"status": "ready" if ok else f"http {status}"}, status_code=200 if ok else 503)

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k not in REQUEST_DROP]
        try:
            body = await read_body(receive)
        except ClientGone:
            return
        try:
            up = await self.relay.open(scope["method"], target(self.upstream, scope), headers, body)
        except UpstreamError as e:
            return await send_json(send, 502, error_body(f"upstream unreachable ({type(e).__name__})",
                                                         "upstream_unreachable", kind="server_error"))
        await relay_response(up, receive, send)
