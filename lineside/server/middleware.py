"""One pure-ASGI middleware (no BaseHTTPMiddleware: it costs latency and hides disconnects) for:
the request id header, the API key, refusing generation while loading or draining, the body (size
limit, UTF-8 only, cut short by a drain), and counting requests in flight (what a drain waits for)."""

from __future__ import annotations

import asyncio
import codecs
import json
import re
import time
import uuid
from typing import Any

from starlette.exceptions import HTTPException

from lineside.server import prompt_limits
from lineside.server.auth import AccessPolicy
from lineside.server.errors import count_invalid, route_path
from lineside.server.state import ServerState

# every route that runs a generation: counted in flight (what a drain waits for), refused while loading or draining
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/prefill", "/v1/responses"})
# routes that read a prompt with the engine's tokenizer: the same readiness, drain and body limits
ENGINE_PATHS = GENERATION_PATHS | {"/tokenize", "/detokenize", "/v1/responses/input_tokens"}
PREFILL_PATH = "/v1/prefill"
_RID_OK = re.compile(r"^[\x21-\x7e]{1,200}$")


class ServerMiddleware:
    def __init__(self, app: Any, state: ServerState, *, max_body_bytes: int | None = None, metrics_public: bool = False):
        self.app = app
        self.state = state
        self._explicit_body_limit = max_body_bytes
        self._derived_body_limit: int | None = None
        self.access = AccessPolicy(state.api_key, metrics_public)

    @property
    def max_body(self) -> int:
        """The body limit given, else the one the loaded model's context makes worth reading (prompt_limits)."""
        if self._explicit_body_limit is not None:
            return self._explicit_body_limit
        if self._derived_body_limit is None:
            engine = self.state.engine
            if not self.state.engine_ready:
                return prompt_limits.MAX_BODY_BYTES
            self._derived_body_limit = prompt_limits.body_limit(engine.tokenizer, engine.max_seq_len)
        return self._derived_body_limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = _headers(scope)
        # an empty header is an absent one: a proxy that forwards an unset variable (X-Request-Id: $id) sends it empty,
        # and a 400 then refused every request through it, health probes included
        request_id = headers.get("x-request-id") or None
        id_header = [(b"x-request-id", (request_id or "").encode("latin-1"))]
        if request_id is not None and not _RID_OK.fullmatch(request_id):
            id_header = []
            count_invalid(self.state, scope)
            await _reply(send, 400, "X-Request-Id must be 1-200 printable ASCII characters without spaces; send such "
                                    "an id or leave the header out (the server then makes one)",
                         code="invalid_request_id", headers=id_header)
            return
        if request_id is None:
            request_id = "req-" + uuid.uuid4().hex
            id_header = [(b"x-request-id", request_id.encode())]
        request_state = scope.setdefault("state", {})
        request_state["request_id"], request_state["t0"] = request_id, t0
        path = route_path(scope)  # behind --root-path: the route's path, as the router matches it
        state = self.state

        if self.access.needs_key(path):
            accepted, what = self.access.key_matches(headers.get("authorization", ""))
            if not accepted:
                state.metrics.reject("unauthorized")
                await _reply(send, 401, f"{what}: send the header 'Authorization: Bearer <key>' with the "
                                        "server's key", code="invalid_api_key", headers=id_header,
                             extra=[(b"www-authenticate", b"Bearer")])
                return

        posted = scope.get("method") == "POST"  # every POST body is bounded, not only a generation's
        generating = path in ENGINE_PATHS and posted
        if generating:
            if state.draining and path == PREFILL_PATH:  # a session here would die with the server: 4xx, not retry
                state.metrics.reject("draining")
                await _reply(send, 409, "server is shutting down: prefill sessions cannot be made or extended here; "
                                        "send the prompt to another instance", code="draining", headers=id_header,
                             extra=[(b"connection", b"close")])
                return
            if state.draining:
                state.metrics.reject("draining")
                await _reply(send, 503, "server is shutting down and takes no new requests; retry on another "
                                        "instance or after it restarts", code="draining", headers=id_header,
                             extra=[(b"retry-after", b"5"), (b"connection", b"close")])
                return
            if state.engine_failure is not None:
                state.metrics.reject("engine_failed")
                await _reply(send, 503, f"the model engine failed ({state.engine_failure}) and takes no requests; "
                                        "retry on another instance", code="engine_failed", headers=id_header,
                             extra=[(b"connection", b"close")])
                return
            if not state.engine_ready:
                msg = (f"model failed to load: {state.load_error}" if state.load_error
                       else "model is still loading; retry when GET /health/ready answers 200")
                state.metrics.reject("not_ready")
                await _reply(send, 503, msg, code="not_ready", headers=id_header, extra=[(b"retry-after", b"1")])
                return
        if posted:
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                state.metrics.reject("invalid")
                await _reply(send, 413, f"request body has {length} bytes; the limit is {self.max_body}",
                             code="body_too_large", headers=id_header, extra=[(b"connection", b"close")])  # don't read it
                return

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + id_header
            await send(message)

        if not generating:
            body = _guarded_body(receive, self.max_body, state, drain=False) if posted else receive
            await self.app(scope, body, send_with_id)
            return
        state.enter()
        try:
            await self.app(scope, _guarded_body(receive, self.max_body, state), send_with_id)
        finally:
            state.leave()


class BodyRefused(HTTPException):
    """Raised from receive(): FastAPI re-raises HTTPExceptions met while reading the body, so the client gets
    this status with an OpenAI-shaped body (see app.py) instead of a parse error."""

    def __init__(self, status: int, message: str, code: str, *, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.code = code


def _guarded_body(receive: Any, limit: int, state: ServerState, *, drain: bool = True) -> Any:
    """receive() that enforces the body limit on bodies without a Content-Length (chunked uploads) too,
    refuses bytes that are not UTF-8 (JSON's only encoding here: no UTF-16 sniffing), and (``drain``: a request
    the drain waits for) answers 503 to a body still arriving when a drain starts, so a half-sent upload cannot
    hold the drain."""
    seen = 0
    utf8 = codecs.getincrementaldecoder("utf-8")()

    body_done = False

    async def wrapped() -> dict:
        if body_done:  # later calls wait for a disconnect (streaming responses): nothing to guard
            return await receive()
        if not drain:
            return check(await receive())
        if state.draining:
            raise _draining()
        pending = asyncio.ensure_future(receive())
        drain_started = asyncio.ensure_future(state.drain_started.wait())
        try:
            done, _ = await asyncio.wait({pending, drain_started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain_started.cancel()
        if pending not in done:
            pending.cancel()
            raise _draining()
        return check(pending.result())

    def check(message: dict) -> dict:
        nonlocal seen, body_done
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                raise BodyRefused(413, f"request body is over the limit of {limit} bytes; send less", "body_too_large")
            if b"\x00" in chunk:  # JSON text never holds a raw NUL; UTF-16/32 of ASCII is full of them
                raise BodyRefused(400, "request body holds NUL bytes (UTF-16 or UTF-32?); send JSON encoded as UTF-8",
                                  "invalid_utf8")
            try:
                utf8.decode(chunk, final=not message.get("more_body", False))
            except UnicodeDecodeError as e:
                raise BodyRefused(400, f"request body is not UTF-8 (invalid byte at offset {seen - len(chunk) + e.start});"
                                       " send JSON encoded as UTF-8", "invalid_utf8") from None
            body_done = not message.get("more_body", False)
        return message

    return wrapped


def _draining() -> BodyRefused:
    return BodyRefused(503, "server is shutting down and takes no new requests (the body was still arriving); "
                            "retry on another instance or after it restarts", "draining",
                       headers={"Retry-After": "5", "Connection": "close"})


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
