"""A pass-through in front of a server that has no ``GET /health`` (llama-cpp-python's OpenAI server).

SMG registers an HTTP worker only after ``GET <url>/health`` answers 2xx: the path is fixed in its source
(model_gateway/src/workflow/steps/util.rs, ``http_health_url``), whatever ``--health-check-endpoint`` says, so
such a server never joins a pool. This adapter answers ``/health`` and ``/health/ready`` from the node's own
health path (``/v1/models`` works for any OpenAI server) and streams every other request through unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lineside.fleet.front import HOP_BY_HOP


class HealthAdapter:
    """ASGI app: /health from ``upstream + health_path``, the rest passed through."""

    def __init__(self, upstream: str, health_path: str, timeout_s: float = 600.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.health_path = health_path
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), trust_env=False,
                                        limits=httpx.Limits(max_connections=512, max_keepalive_connections=128))
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/health/ready", self.health, methods=["GET"]),
            Route("/{path:path}", self.proxy, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.client.aclose()

    async def health(self, request: Request) -> JSONResponse:
        try:
            r = await self.client.get(self.upstream + self.health_path, timeout=5.0)
        except httpx.HTTPError as e:
            return JSONResponse({"status": "unreachable", "reason": type(e).__name__}, status_code=503)
        ok = r.status_code == 200
        return JSONResponse({"status": "ready" if ok else f"http {r.status_code}"}, status_code=200 if ok else 503)

    async def proxy(self, request: Request) -> Response:
        url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
        req = self.client.build_request(request.method, url, headers=headers, content=await request.body())
        try:
            up = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"upstream unreachable ({type(e).__name__})",
                                           "type": "server_error", "code": "upstream_unreachable", "param": None}},
                                status_code=502)
        out = {k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding"}
        return StreamingResponse(up.aiter_raw(), status_code=up.status_code, headers=out,
                                 background=BackgroundTask(up.aclose))
