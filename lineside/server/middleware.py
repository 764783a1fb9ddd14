"""One pure-ASGI middleware (no BaseHTTPMiddleware: it costs latency and hides disconnects) for:
the request id header, the API key, refusing generation while loading or draining, the body size
limit, and counting requests in flight (what a drain waits for)."""

from __future__ import annotations

import hmac
import json
import re
import time
import uuid
from typing import Any

from lineside.server.state import ServerState

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_RID_OK = re.compile(r"^[\x21-\x7e]{1,200}$")


class ServerMiddleware:
    def __init__(self, app: Any, state: ServerState, max_body_bytes: int = 32 << 20):
        self.app = app
        self.state = state
        self.max_body = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = _headers(scope)
        request_id = headers.get("x-request-id")
        id_header = [(b"x-request-id", (request_id or "").encode("latin-1"))]
        if request_id is not None and not _RID_OK.match(request_id):
            id_header = []
            await _reply(send, 400, "X-Request-Id must be 1-200 printable ASCII characters without spaces",
                         code="invalid_request_id", headers=id_header)
            return
        if request_id is None:
            request_id = "req-" + uuid.uuid4().hex
            id_header = [(b"x-request-id", request_id.encode())]
        request_state = scope.setdefault("state", {})
        request_state["request_id"], request_state["t0"] = request_id, t0
        path: str = scope.get("path", "")
        state = self.state

        if state.api_key is not None and path.startswith("/v1/"):
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not token or not hmac.compare_digest(token.encode(), state.api_key.encode()):
                state.metrics.reject("unauthorized")
                what = "wrong API key" if token else "missing API key"
                await _reply(send, 401, f"{what}: send the header 'Authorization: Bearer <key>' with the "
                                        "server's key", code="invalid_api_key", headers=id_header,
                             extra=[(b"www-authenticate", b"Bearer")])
                return

        generating = path in GENERATION_PATHS and scope.get("method") == "POST"
        if generating:
            if state.draining:
                state.metrics.reject("draining")
                await _reply(send, 503, "server is shutting down and takes no new requests; retry on another "
                                        "instance or after it restarts", code="draining", headers=id_header,
                             extra=[(b"retry-after", b"5"), (b"connection", b"close")])
                return
            if not state.engine_ready:
                msg = (f"model failed to load: {state.load_error}" if state.load_error
                       else "model is still loading; retry when GET /health/ready answers 200")
                await _reply(send, 503, msg, code="not_ready", headers=id_header, extra=[(b"retry-after", b"1")])
                return
            ctype = headers.get("content-type", "")
            if "json" not in ctype.lower():
                # `curl -d` and some clients send JSON labelled as a form (or unlabelled): read it as JSON
                scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
                scope["headers"].append((b"content-type", b"application/json"))
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                state.metrics.reject("invalid")
                await _reply(send, 413, f"request body has {length} bytes; the limit is {self.max_body}",
                             code="body_too_large", headers=id_header)
                return

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + id_header
            await send(message)

        if not generating:
            await self.app(scope, receive, send_with_id)
            return
        state.enter()
        try:
            await self.app(scope, _limited(receive, self.max_body), send_with_id)
        finally:
            state.leave()


def _limited(receive: Any, limit: int) -> Any:
    """receive() that enforces the body limit on bodies without a Content-Length (chunked uploads) too:
    FastAPI re-raises an HTTPException from reading the body, so the client gets the 413."""
    seen = 0

    async def wrapped() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                from starlette.exceptions import HTTPException

                raise HTTPException(413, f"request body is over the limit of {limit} bytes; send less")
        return message

    return wrapped


def _headers(scope: dict) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _reply(send: Any, status: int, message: str, *, code: str, headers: list[tuple[bytes, bytes]],
                 extra: list[tuple[bytes, bytes]] | None = None) -> None:
    from lineside.server.errors import APIError

    body = json.dumps(APIError(status, message, code).body()).encode()
    all_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *headers, *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})
