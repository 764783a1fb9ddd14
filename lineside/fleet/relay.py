"""The ASGI pass-through of the health adapter (an ASGI request relayed to an upstream over pooled keep-alive
connections, the response streamed back byte for byte), and the aiohttp client the front uses off its hot path
(shadow copies, pool health checks). The front's own proxy path is lineside.fleet.passthrough.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]
UpstreamError = (aiohttp.ClientError, asyncio.TimeoutError)  # the upstream could not be reached or answer

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailers", b"transfer-encoding", b"upgrade"})
REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length"}  # the upstream request gets its own


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def read_body(receive: Receive) -> bytes:
    first = await receive()
    if first["type"] == "http.disconnect":
        raise ClientGone
    if not first.get("more_body"):
        return first.get("body", b"")
    chunks = [first.get("body", b"")]
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(m.get("body", b""))
        if not m.get("more_body"):
            return b"".join(chunks)


def target(base: str, scope: Scope) -> str:
    qs = scope.get("query_string") or b""
    return base + scope["path"] + ("?" + qs.decode("latin-1") if qs else "")


class Upstream:
    """One aiohttp session (made in the serving event loop, on first use): keep-alive connections reused
    across requests, no retries (SMG retries), no cookie jar (cookies pass through as headers), no automatic
    Accept-Encoding / User-Agent (what the client sent goes on; compressed bodies are passed raw)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=2048, limit_per_host=0, keepalive_timeout=30),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, timeout=self._timeout,
                skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._session

    async def open(self, method: str, url: str, headers: RawHeaders, body: bytes,
                   timeout_s: float | None = None) -> aiohttp.ClientResponse:
        """The upstream's response, its body not read yet (the caller relays or reads it, then closes it)."""
        hs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        return await self.session().request(method, url, headers=hs, data=body or None, allow_redirects=False,
                                            timeout=timeout or self._timeout)

    async def read(self, method: str, url: str, headers: RawHeaders, body: bytes,
                   timeout_s: float | None = None) -> tuple[int, str, bytes]:
        """(status, content type, whole body) of one upstream call."""
        r = await self.open(method, url, headers, body, timeout_s)
        try:
            return r.status, r.headers.get("Content-Type", ""), await r.read()
        finally:
            r.release()

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def is_event_stream(up: aiohttp.ClientResponse) -> bool:
    return up.headers.get("Content-Type", "").startswith("text/event-stream")


async def relay_response(up: aiohttp.ClientResponse, receive: Receive, send: Send, *,
                         extra_headers: Iterable[tuple[bytes, bytes]] = (), keep: list[bytes] | None = None) -> None:
    """Stream ``up`` to the client unchanged (status, end-to-end headers, body bytes as they arrive); ``keep``
    collects the body too. A client that goes away mid-stream closes the upstream connection (the node stops
    generating); an upstream cut mid-body raises, so the server aborts the connection and the client sees
    the response incomplete."""
    headers = [(k, v) for k, v in up.raw_headers if k.lower() not in HOP_BY_HOP]
    headers.extend(extra_headers)
    watcher = None
    if is_event_stream(up):  # a stream can wait long for its next event: its client may leave meanwhile
        watcher = asyncio.ensure_future(_disconnected(receive))
        watcher.add_done_callback(lambda _: up.close())  # ends the read below; a no-op once released
    done = False
    try:
        await send({"type": "http.response.start", "status": up.status, "headers": headers})
        async for chunk in up.content.iter_any():
            if keep is not None:
                keep.append(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if watcher is not None and watcher.done():
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        done = True
    except UpstreamError:
        if watcher is not None and watcher.done():
            return  # closed here because the client left
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        if done:
            up.release()
        else:
            up.close()


async def send_json(send: Send, status: int, payload: dict[str, Any],
                    extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def error_body(message: str, code: str, param: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


async def lifespan(receive: Receive, send: Send, on_shutdown: Callable[[], Awaitable[None]]) -> None:
    """The ASGI lifespan protocol: nothing to start, ``on_shutdown`` at the end."""
    while True:
        m = await receive()
        if m["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif m["type"] == "lifespan.shutdown":
            await on_shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
