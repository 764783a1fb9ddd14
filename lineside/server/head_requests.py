"""HEAD answered as GET without a body, on every route that has GET (/health, /health/ready, /v1/models,
/metrics, ...): load balancers and uptime checkers probe with HEAD, and FastAPI's GET routes answer it 405."""

from __future__ import annotations

from typing import Any

from starlette.routing import Match, Router


class HeadAsGet:
    """Pure-ASGI middleware: a HEAD whose path a GET route matches runs that route as a GET; the answer keeps its
    status and headers (Content-Length included, as RFC 9110 allows) and drops its body. Other HEADs pass as they
    are (a POST-only route's 405 names HEAD)."""

    def __init__(self, app: Any, router: Router):
        self.app = app
        self.router = router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return
        as_get = {**scope, "method": "GET"}  # a copy: the server still knows it answers a HEAD
        if not any(route.matches(as_get)[0] == Match.FULL for route in self.router.routes):
            await self.app(scope, receive, send)
            return

        async def send_head(message: dict) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # a streamed body: nothing of it is sent; the last message ends the answer
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        await self.app(as_get, receive, send_head)
