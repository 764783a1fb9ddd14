"""The gateway front's HTTP/1.1 layer at the asyncio Protocol level: parse a request head (httptools), let the
front decide, forward the request to a kept-alive upstream connection, stream the response bytes back as they
arrive, unchanged except for the headers the front adds.

Why not ASGI + an HTTP client: on a 2-core box the front's CPU per request competes with the model; the ASGI
scope/receive/send layers and the client library's response objects were most of it. Here a response chunk is
written to the client inside the upstream socket's ``data_received``: no task, no await, no re-encoding
(chunked framing passes through as is). httptools (llhttp) does all the parsing and framing on both sides.
HTTP/1.0 has no chunked coding: a chunked answer to a 1.0 client goes on unframed, ended by the connection's close
(as the server's own HTTP layer and nginx answer one).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httptools

RawHeaders = list[tuple[bytes, bytes]]
IDLE_S = 75.0  # a client connection without a request this long is closed (nginx's keepalive_timeout default)
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailers", b"transfer-encoding", b"upgrade", b"expect"})
REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length"}  # the upstream request gets its own
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 502: b"Bad Gateway",
            503: b"Service Unavailable"}


@dataclass
class RequestHead:
    method: str
    target: bytes  # path and query as the client sent them
    path: str
    version: str  # "1.1" or "1.0"
    headers: RawHeaders  # names lower-cased, in order


@dataclass
class Answer:
    """A response the front writes itself (its own endpoints, errors)."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    headers: RawHeaders = field(default_factory=list)


def error_body(message: str, code: str, *, param: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """The OpenAI error object every answer of the gateway's own carries."""
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def error_answer(status: int, message: str, code: str, *, param: str | None = None,
                 kind: str = "invalid_request_error") -> Answer:
    """An error the front answers itself, JSON-encoded (so any text in ``message`` stays valid JSON)."""
    return Answer(status, json.dumps(error_body(message, code, param=param, kind=kind)).encode())


@dataclass
class Forward:
    """Where and how the request goes on: ``headers`` replace the client's (no Host / Content-Length /
    hop-by-hop), ``body`` rewrites the whole body when set, ``add_response`` is written into the response head,
    ``done(status, content type, response body or None, seconds, request body sent)`` is called once the
    response has been relayed; ``prefix`` goes before the client's path (an upstream base URL's path)."""

    host: str
    port: int
    headers: RawHeaders
    prefix: bytes = b""
    body: Callable[[bytes], bytes] | None = None
    add_response: RawHeaders = field(default_factory=list)
    keep_body: bool = False
    done: Callable[[int, bytes, bytes | None, float, bytes], None] | None = None
    unreachable: Callable[[str], Answer] | None = None  # the answer when the upstream cannot be reached
    # a response with one of these statuses is held whole (not streamed on) and handed to ``replace``, which may
    # answer in its place (an upstream's error that means something else to the client); None: sent as it came
    replace_statuses: frozenset[int] = frozenset()
    replace: Callable[[int, bytes], Awaitable[Answer | None]] | None = None


Decide = Callable[[RequestHead], "Forward | Answer | Awaitable[Answer]"]


def encode_answer(a: Answer, version: str, keep_alive: bool) -> bytes:
    head = [f"HTTP/{version} {a.status} ".encode() + _REASONS.get(a.status, b"Error"),
            b"content-type: " + a.content_type, b"content-length: " + str(len(a.body)).encode()]
    head += [k + b": " + v for k, v in a.headers]
    if not keep_alive:
        head.append(b"connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + a.body


class UpstreamPool:
    """Idle kept-alive connections per (host, port); a connection the upstream closes leaves the pool."""

    def __init__(self, timeout_s: float, max_idle: int = 256) -> None:
        self.timeout_s = timeout_s
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], collections.deque[UpstreamConn]] = {}

    async def get(self, host: str, port: int) -> tuple[UpstreamConn, bool]:
        """(a connection, whether it was reused)."""
        idle = self._idle.get((host, port))
        while idle:
            c = idle.pop()
            if not c.closed:
                return c, True
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(lambda: UpstreamConn(self, (host, port)), host, port),
                                         timeout=5.0)
        return conn, False

    def put(self, c: UpstreamConn) -> None:
        idle = self._idle.setdefault(c.key, collections.deque())
        if len(idle) < self.max_idle and not c.closed:
            idle.append(c)
        else:
            c.close()

    def discard(self, c: UpstreamConn) -> None:
        idle = self._idle.get(c.key)
        if idle and c in idle:
            idle.remove(c)

    def close(self) -> None:
        for idle in self._idle.values():
            for c in idle:
                c.close()
        self._idle.clear()


class UpstreamConn(asyncio.Protocol):
    """One upstream socket; while it carries a response, each chunk goes straight to the client's transport."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.exchange: Exchange | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio classes

    def data_received(self, data: bytes) -> None:
        if self.exchange is not None:
            self.exchange.upstream_data(data)
        else:  # bytes nobody asked for: the connection is not reusable
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        if self.exchange is not None:
            self.exchange.upstream_lost()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Exchange:
    """One request relayed: sends it, parses the response for its framing, writes it on to the client."""

    def __init__(self, client: ClientConn, fwd: Forward, head: RequestHead, keep_alive: bool) -> None:
        self.client, self.fwd, self.head, self.keep_alive = client, fwd, head, keep_alive
        self.parser = httptools.HttpResponseParser(self)
        self.buf: bytearray | None = bytearray()  # the response head until it is complete
        self.head_sent = False
        self.heads = 0  # response heads parsed and not yet written on or dropped
        self.interim = 0  # of those, 1xx heads (dropped: the front asked for no 100-continue)
        self.framed = False  # Content-Length or chunked: the end is in the bytes, not the connection's close
        self.chunked = False
        # a chunked answer to an HTTP/1.0 client (which knows no chunked coding): its body goes on unframed, as
        # parsed out of the chunks, and the client's connection closes after it (the close is what ends it)
        self.unframed = False
        self._pieces: list[bytes] = []  # unframed body parsed from the bytes being fed, not yet written
        self.status = 0
        self.ctype = b""
        self.kept: list[bytes] | None = [] if fwd.keep_body else None
        self.held: list[bytes] | None = None  # the body of a response held for ``fwd.replace``
        self.upstream_keep_alive = True
        self.finished: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.conn: UpstreamConn | None = None
        self.got_bytes = False
        self.t0 = time.perf_counter()
        self.last_read = time.monotonic()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-type":
            self.ctype = value
        elif n in (b"content-length", b"transfer-encoding"):
            self.framed = True
            if n == b"transfer-encoding" and b"chunked" in value.lower():
                self.chunked = True

    def on_headers_complete(self) -> None:
        self.heads += 1
        self.status = self.parser.get_status_code()
        self.upstream_keep_alive = self.parser.should_keep_alive()
        if self.status >= 200 and self.chunked and self.head.version == "1.0" and self.head.method != "HEAD":
            self.unframed = True
        if self.status in self.fwd.replace_statuses and not self.unframed and self.head.method != "HEAD":
            self.held = []

    def on_body(self, body: bytes) -> None:
        if self.kept is not None:
            self.kept.append(body)
        if self.unframed:
            self._pieces.append(body)
        if self.held is not None:
            self.held.append(body)

    def on_message_complete(self) -> None:
        if self.status < 200:  # an interim 1xx response: dropped, the real one follows
            self.interim += 1
            self.framed = self.chunked = False
            return
        if not self.finished.done():
            self.finished.set_result(True)

    # from the upstream connection
    def upstream_data(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_read = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.upstream_keep_alive = False
            self.fail()
            return
        if self.head_sent:
            if self.unframed:
                self._write_pieces()
            else:
                self.client.write(data)
            return
        assert self.buf is not None
        self.buf += data
        while self.interim:
            del self.buf[:self.buf.find(b"\r\n\r\n") + 4]
            self.interim -= 1
            self.heads -= 1
        if self.heads and self.held is None:
            self.send_head()

    def send_head(self) -> None:
        """Write the response head (with the front's headers) and the body bytes buffered after it."""
        assert self.buf is not None
        end = self.buf.find(b"\r\n\r\n") + 2  # the head without its final CRLF (llhttp wants CRLF there)
        extra = b"".join(k + b": " + v + b"\r\n" for k, v in self.fwd.add_response)
        if not self.keep_alive and self.head.version == "1.1":
            extra += b"connection: close\r\n"
        if self.unframed:  # no Transfer-Encoding (nor the upstream's keep-alive): the close ends the body
            kept = [line for line in bytes(self.buf[:end]).split(b"\r\n")[:-1]
                    if line.split(b":", 1)[0].strip().lower() not in (b"transfer-encoding", b"connection", b"keep-alive")]
            out = b"\r\n".join(kept) + b"\r\n" + extra + b"connection: close\r\n\r\n"
        else:
            out = bytes(self.buf[:end]) + extra + bytes(self.buf[end:])
        self.buf = None
        self.head_sent = True
        self.client.write(out)
        if self.unframed:
            self._write_pieces()
        if self.head.method == "HEAD" and not self.finished.done():  # no body follows, whatever the head says
            self.finished.set_result(True)

    def _write_pieces(self) -> None:
        if self._pieces:
            self.client.write(b"".join(self._pieces))
            self._pieces.clear()

    def upstream_lost(self) -> None:
        if self.finished.done():  # closed after a complete response: only that connection is done
            return
        self.upstream_keep_alive = False
        if (self.head_sent or self.held is not None) and not self.framed:  # delimited by the connection's end
            self.finished.set_result(True)
            return
        self.fail()

    def fail(self) -> None:
        if not self.finished.done():
            self.finished.set_result(False)

    def idle_s(self) -> float:
        return time.monotonic() - self.last_read


class ClientConn(asyncio.Protocol):
    """One client connection: requests parsed as they come, answered one after another (pipelining kept in
    order); the upstream stream is cut when the client goes away."""

    def __init__(self, decide: Decide, pool: UpstreamPool, idle_s: float = IDLE_S) -> None:
        self.decide, self.pool, self.idle_s = decide, pool, idle_s
        self._idle_timer: asyncio.TimerHandle | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.gone = False
        self.queue: collections.deque[tuple[RequestHead, bytes, bool]] = collections.deque()
        self.busy = False
        self.current: Exchange | None = None
        self._url = b""
        self._headers: RawHeaders = []
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio classes
        self._arm_idle()

    def _arm_idle(self) -> None:
        """Close a kept-alive connection that stays without a request for idle_s."""
        self._idle_timer = asyncio.get_running_loop().call_later(self.idle_s, self._idle)

    def _idle(self) -> None:
        if not self.busy and not self.queue and self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse("upgrades are not supported by the gateway")
        except httptools.HttpParserError:
            self._refuse("malformed HTTP request")

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        ex = self.current
        if ex is not None and ex.conn is not None and not ex.finished.done():
            ex.conn.abort()  # the node's stream ends now instead of generating for nobody

    def write(self, data: bytes) -> None:
        if not self.gone and self.transport is not None:
            self.transport.write(data)

    def pause_writing(self) -> None:  # a slow client: stop reading the upstream until it catches up
        ex = self.current
        if ex is not None and ex.conn is not None and ex.conn.transport is not None:
            ex.conn.transport.pause_reading()

    def resume_writing(self) -> None:
        ex = self.current
        if ex is not None and ex.conn is not None and ex.conn.transport is not None:
            ex.conn.transport.resume_reading()

    def _refuse(self, why: str) -> None:
        self.write(encode_answer(error_answer(400, why, "bad_request"), "1.1", keep_alive=False))
        if self.transport is not None:
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if any(k == b"expect" and v.lower() == b"100-continue" for k, v in self._headers):
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url = self._url
        q = url.find(b"?")
        path = (url if q < 0 else url[:q]).decode("latin-1")
        head = RequestHead(self.parser.get_method().decode("latin-1"), url, path, self.parser.get_http_version(),
                           self._headers)
        self.queue.append((head, b"".join(self._body), self.parser.should_keep_alive()))
        if not self.busy:
            self.busy = True
            asyncio.get_running_loop().create_task(self._serve_queue())

    async def _serve_queue(self) -> None:
        try:
            while self.queue and not self.gone:
                head, body, keep_alive = self.queue.popleft()
                keep_alive = await self._serve(head, body, keep_alive)
                if not keep_alive:
                    if self.transport is not None:
                        self.transport.close()
                    return
        finally:
            self.busy = False
            if not self.gone:
                self._arm_idle()

    async def _serve(self, head: RequestHead, body: bytes, keep_alive: bool) -> bool:
        """Answer one request; whether the client connection stays open."""
        try:
            return await self._serve_one(head, body, keep_alive)
        except Exception as e:  # noqa: BLE001 - one failed request must not leave its client hanging
            if self.transport is not None and not self.gone:
                if self.current is None or not self.current.head_sent:
                    a = error_answer(502, f"gateway error: {type(e).__name__}", "gateway_error", kind="server_error")
                    self.write(encode_answer(a, head.version, keep_alive=False))
                self.transport.close()
            return False

    async def _serve_one(self, head: RequestHead, body: bytes, keep_alive: bool) -> bool:
        d = self.decide(head)
        if not isinstance(d, (Forward, Answer)):
            d = await d
        if isinstance(d, Answer):
            self.write(encode_answer(d, head.version, keep_alive))
            return keep_alive
        return await self._forward(d, head, body, keep_alive)

    async def _forward(self, fwd: Forward, head: RequestHead, body: bytes, keep_alive: bool) -> bool:
        if fwd.body is not None:
            body = fwd.body(body)
        lines = [f"{head.method} ".encode() + fwd.prefix + head.target + f" HTTP/{head.version}".encode(),
                 f"host: {fwd.host}:{fwd.port}".encode()]
        lines += [k + b": " + v for k, v in fwd.headers if k not in REQUEST_DROP]  # framing is this layer's
        if body or head.method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: " + str(len(body)).encode())
        wire = b"\r\n".join(lines) + b"\r\n\r\n" + body
        for attempt in (0, 1):  # once more on a fresh connection when a reused one was closed under us
            ex = Exchange(self, fwd, head, keep_alive)
            try:
                conn, reused = await self.pool.get(fwd.host, fwd.port)
            except (OSError, asyncio.TimeoutError) as e:
                return self._unreachable(fwd, head, keep_alive, type(e).__name__)
            if self.gone:
                self.pool.put(conn)
                return False
            ex.conn, conn.exchange = conn, ex
            self.current = ex
            assert conn.transport is not None
            conn.transport.write(wire)
            ok = await self._wait(ex)
            conn.exchange = None
            self.current = None
            if ok and ex.held is not None:  # held for the front: its answer, or the response as it came
                a = await fwd.replace(ex.status, b"".join(ex.held)) if fwd.replace is not None else None
                if a is not None:
                    ex.status, ex.ctype, ex.kept = a.status, a.content_type, None
                    self.write(encode_answer(a, head.version, keep_alive))
                    ex.framed = True
                else:
                    ex.send_head()
            if ok:
                if ex.upstream_keep_alive and head.version == "1.1":
                    self.pool.put(conn)
                else:
                    conn.close()
                if fwd.done is not None:
                    body_kept = b"".join(ex.kept) if ex.kept is not None else None
                    fwd.done(ex.status, ex.ctype, body_kept, time.perf_counter() - ex.t0, body)
                # the client's connection outlives the router's unless the body was delimited by its close (the
                # router's, or, to an HTTP/1.0 client, the front's)
                return keep_alive and not ex.unframed and (ex.framed or head.method == "HEAD")
            conn.abort()
            if self.gone:
                return False
            if ex.head_sent:  # cut mid-response: the client must see it incomplete
                if self.transport is not None:
                    self.transport.abort()
                return False
            if not (reused and not ex.got_bytes and attempt == 0):
                return self._unreachable(fwd, head, keep_alive, "ServerDisconnectedError")
        return False

    async def _wait(self, ex: Exchange) -> bool:
        """Whether the response completed; False when the upstream went away or sent nothing for timeout_s."""
        loop = asyncio.get_running_loop()
        timeout = self.pool.timeout_s

        def watchdog() -> None:
            nonlocal timer
            idle = ex.idle_s()
            if idle >= timeout:
                ex.fail()
            elif not ex.finished.done():
                timer = loop.call_later(timeout - idle, watchdog)

        timer = loop.call_later(timeout, watchdog)
        try:
            return await ex.finished
        finally:
            timer.cancel()

    def _unreachable(self, fwd: Forward, head: RequestHead, keep_alive: bool, why: str) -> bool:
        a = fwd.unreachable(why) if fwd.unreachable is not None else error_answer(
            502, f"upstream unreachable: {why}", "upstream_unreachable", kind="server_error")
        self.write(encode_answer(a, head.version, keep_alive))
        return keep_alive


async def serve(decide: Decide, pool: UpstreamPool, *, host: str, port: int) -> asyncio.Server:
    """Listen on host:port; each connection is a ClientConn."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: ClientConn(decide, pool), host, port, reuse_address=True)
