"""HTTP/1.1 connection hygiene under uvicorn: the parser is httptools (llhttp, Node.js's parser), which
already refuses Content-Length together with Transfer-Encoding and malformed or overflowing chunk sizes;
this subclass adds what no stack we measured does (benchmarks/http_stacks.py): a deadline for the
request head, a header count and size limit, a body-progress timeout, a send timeout for a client that stops
taking its answer, and OpenAI-shaped refusals that close the connection, so nothing after a bad message is ever
parsed as a request. It also caps open
connections per client address and in all (as nginx's limit_conn does): one client cannot take every
socket the server has.

It relies on uvicorn's HttpToolsProtocol internals (its callbacks and per-connection attributes):
:func:`check_uvicorn` names what it needs and pyproject pins the uvicorn versions it was checked against.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lineside.errors import LinesideError
from lineside.server.browser_guard import CorsSettings
from lineside.server.errors import APIError

log = logging.getLogger("lineside.server")

# The uvicorn releases this subclass was checked against (pyproject pins the same range), and what it uses.
UVICORN_TESTED = ((0, 30), (0, 55))  # >= first, < second
_PROTOCOL_METHODS = ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_url",
                     "on_header", "on_headers_complete", "on_body", "on_message_complete",
                     "_unset_keepalive_if_required", "shutdown")
# per connection, after connection_made: and the request cycle's, once a head is parsed
PROTOCOL_ATTRIBUTES = ("loop", "transport", "parser", "flow", "client", "cycle", "server_state", "connections")
CYCLE_ATTRIBUTES = ("response_complete", "response_started", "disconnected", "message_event", "send", "keep_alive",
                    "chunked_encoding", "expected_content_length")


def check_uvicorn(protocol: Any = None, *, strict_version: bool = False) -> None:
    """One line (LinesideError) when the installed uvicorn lacks what the guard overrides or reads (given a
    ``protocol`` that has parsed a request head, its attributes too), or, with ``strict_version`` (the test
    suite), is outside the tested range; `serve` only warns about the range."""
    version = tuple(int(p) for p in uvicorn.__version__.split(".")[:2] if p.isdigit())
    missing = [f"HttpToolsProtocol.{m}" for m in _PROTOCOL_METHODS if not callable(getattr(HttpToolsProtocol, m, None))]
    if protocol is not None:
        missing += [f"protocol.{a}" for a in PROTOCOL_ATTRIBUTES if not hasattr(protocol, a)]
        cycle = getattr(protocol, "cycle", None)
        missing += [f"cycle.{a}" for a in CYCLE_ATTRIBUTES if cycle is None or not hasattr(cycle, a)]
        if not hasattr(getattr(protocol, "flow", None), "read_paused"):
            missing.append("flow.read_paused")
    low, high = UVICORN_TESTED
    in_range = low <= version < high
    if missing or (strict_version and not in_range):
        what = f"it lacks {', '.join(missing)}" if missing else "it is outside the tested range"
        raise LinesideError(
            f"uvicorn {uvicorn.__version__} does not fit lineside's HTTP guard (lineside/server/http_limits.py "
            f"subclasses its httptools protocol; {what}); install uvicorn>={low[0]}.{low[1]},<{high[0]}.{high[1]} "
            "as pyproject.toml pins it")
    if not in_range:
        log.warning("uvicorn %s is outside the range lineside's HTTP guard was tested with (>=%d.%d,<%d.%d)",
                    uvicorn.__version__, *low, *high)


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits; seconds for timeouts, bytes for sizes."""

    header_timeout: float = 10.0  # from connection (or the end of the last response) to the end of the head
    body_timeout: float = 10.0  # longest pause between two pieces of a request body
    body_deadline: float = 120.0  # whole body, however steadily it trickles
    keep_alive_timeout: float = 5.0  # idle keep-alive connection between requests
    # a client that takes none of its answer (a stream or a body it stopped reading, its TCP window full) this long
    # is cut off: nginx's send_timeout. Without it the connection, and a stream's tokens, were held forever.
    send_timeout: float = 60.0
    max_header_bytes: int = 16 * 1024  # request line + all header lines
    max_header_count: int = 100
    max_connections_per_client: int = 128  # open connections from one address (0: no limit, e.g. behind a gateway)
    max_connections: int = 1024  # open connections in all (lowered to fit the process's file limit)
    refusal_linger: float = 1.0  # seconds a refused connection may take to send its request and read the answer

    def check(self) -> None:
        for name in ("header_timeout", "body_timeout", "body_deadline", "keep_alive_timeout", "send_timeout",
                     "refusal_linger"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("max_header_bytes", "max_header_count", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_connections_per_client < 0:
            raise ValueError(f"max_connections_per_client must be >= 0, got {self.max_connections_per_client}")


class ConnectionCounter:
    """Open connections per client address and in all, for one server (its protocol class owns the one)."""

    def __init__(self, per_client: int, total: int):
        self.per_client, self.total = per_client, total
        self.by_client: dict[str, int] = {}
        self.open = 0
        self.refused = 0
        self.malformed = 0  # requests refused as malformed HTTP (logged sampled, as refusals are)
        self.stalled = 0  # connections cut off because the client took none of its answer for the send timeout

    def admit(self, client: str | None) -> tuple[int, str, str] | None:
        """None (counted in: release it when it closes), or the refusal (status, message, code)."""
        if self.open >= self.total:
            return (503, f"the server has its maximum of {self.total} connections open; retry shortly",
                    "server_busy")
        held = self.by_client.get(client, 0) if client is not None else 0
        if client is not None and self.per_client and held >= self.per_client:
            return (429, f"too many connections from {client}: at most {self.per_client} at once; reuse "
                         "keep-alive connections or close idle ones (the server's --max-connections-per-client)",
                    "too_many_connections")
        if client is not None:
            self.by_client[client] = held + 1
        self.open += 1
        return None

    def release(self, client: str | None) -> None:
        self.open -= 1
        if client is not None:
            left = self.by_client.get(client, 1) - 1
            if left > 0:
                self.by_client[client] = left
            else:
                self.by_client.pop(client, None)


def _sampled(count: int) -> bool:
    """Whether the count-th of a kind of refusal is logged: the 1st, 10th, 100th and every 1000th, so a client
    refused in a loop cannot write the log as fast as it likes."""
    return count in (1, 10, 100) or count % 1000 == 0


_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 429: b"Too Many Requests",
            431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def _refusal(status: int, message: str, code: str, extra: list[tuple[bytes, bytes]] | None = None) -> bytes:
    body = json.dumps(APIError(status, message, code).body()).encode()
    retry = b"retry-after: 1\r\n" if status in (429, 503) else b""
    more = b"".join(b"%s: %s\r\n" % pair for pair in extra or [])
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s%sconnection: close\r\n"
            b"\r\n" % (status, _REASONS[status], len(body), retry, more)) + body


def _malformed_hint(error: Exception, reason: str) -> str:
    """What to do about a request llhttp refused, from what it found: the framing advice fits only framing errors
    (a URL holding a raw space or UTF-8, which curl sends as typed, is not one)."""
    if isinstance(error, httptools.HttpParserInvalidURLError) or reason.startswith("Expected HTTP/"):
        return ("the request line is METHOD URL HTTP/1.1, and the URL is ASCII: percent-encode spaces and "
                "non-ASCII characters in it")
    if isinstance(error, httptools.HttpParserInvalidMethodError):
        return "use a standard method (GET, POST, DELETE)"
    if "PRI" in reason:
        return "this server speaks HTTP/1.1 (and HTTP/1.0) only, not HTTP/2 with prior knowledge (h2c)"
    if any(word in reason for word in ("Content-Length", "Transfer-Encoding", "chunk")):
        return "send one framing (Content-Length or chunked Transfer-Encoding) and valid chunk sizes"
    return "send a well-formed HTTP/1.1 request (CRLF line ends, header names without spaces)"


# the lineside_requests_total outcome a refusal made here is counted under, by its code: as the app's own refusals
# (a malformed or oversized request is ``invalid``, as a 400 / 413 / 415 is)
REFUSAL_OUTCOMES = {"malformed_http": "invalid", "headers_too_large": "invalid", "request_timeout": "request_timeout",
                    "too_many_connections": "too_many_connections", "server_busy": "server_busy"}


def _unframed_for_http10(cycle: Any) -> None:
    """HTTP/1.0 has no chunked coding, and uvicorn's httptools protocol chunks every answer without a length (a
    stream): for a 1.0 request such an answer goes unframed and ends when the connection closes (as h11 and nginx
    do; uvicorn already closes every 1.0 connection after its answer). Answers with a Content-Length are untouched."""
    send = cycle.send
    unframed = False

    async def send_unframed(message: Any) -> None:
        nonlocal unframed
        if message["type"] == "http.response.start" and not cycle.response_started:
            names = {bytes(name).lower() for name, _ in message.get("headers", [])}
            unframed = not names & {b"content-length", b"transfer-encoding"}
            if unframed:
                cycle.keep_alive = False  # the close is what ends the body
                cycle.chunked_encoding = False  # decided: uvicorn adds no Transfer-Encoding and writes bytes as they are
        elif unframed and message["type"] == "http.response.body" and not cycle.response_complete:
            # uvicorn counts unchunked bytes against a Content-Length: let it expect this piece, and after the last
            # one nothing, so it completes the response (and closes the connection) as for a sized body
            cycle.expected_content_length = len(message.get("body", b"")) + (1 if message.get("more_body") else 0)
        await send(message)

    cycle.send = send_unframed


class _CountingTransport:
    """The connection's transport as uvicorn writes to it, counting what it is given: that less what it still
    buffers is what the kernel has taken, i.e. what the client read (asyncio itself tells only high/low water)."""

    def __init__(self, inner: asyncio.Transport, on_write: Callable[[], None]):
        self.inner = inner
        self.written = 0
        self._on_write = on_write

    @property
    def taken(self) -> int:
        return self.written - self.inner.get_write_buffer_size()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        self.inner.write(data)
        self._on_write()

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def __getattr__(self, name: str) -> Any:  # close, is_closing, get_extra_info, ... as the transport's own
        return getattr(self.inner, name)


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing; httptools re-raises it wrapped in HttpParserError."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body deadlines and header limits (see HttpLimits)."""

    limits: HttpLimits = HttpLimits()
    counter: ConnectionCounter = ConnectionCounter(HttpLimits.max_connections_per_client, HttpLimits.max_connections)
    on_refusal: Callable[[str], None] | None = None  # told the outcome of each request refused here (/metrics)
    cors: CorsSettings | None = None  # the app's CORS, for the refusals written here (None: not configured)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_why = ""
        self._admitted = False
        self._over_limit: tuple[int, str, str] | None = None  # refused at connect: answered, then closed
        self._head_bytes = 0
        self._head_count = 0
        self._head_started = False
        self._refused: tuple[int, str, str] | None = None
        self._body_deadline = 0.0
        self._in_body = False
        self._origin: str | None = None  # the request's Origin, once its header is parsed (for CORS on a refusal)
        self._send_timer: asyncio.TimerHandle | None = None  # armed while written bytes wait for the client
        self._send_taken = 0  # what the client had taken at the last check
        self._send_since = 0.0  # loop time it last took something (or the buffer began to fill)

    # ---- timers ---------------------------------------------------------------------------------
    def _arm(self, delay: float, why: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, self._expired, why)
        self._timer_why = why

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, why: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if why in ("linger", "idle"):  # a refused connection had its time to send a request and read the answer;
            self.transport.close()  # or one idle after a request answered before its body came
            return
        if why == "head" and not self._head_started:  # an idle connection that never began a request
            self.transport.close()
            return
        if why == "body" and self.flow.read_paused:  # the app has not read what came: not the client's fault
            self._arm(self.limits.body_timeout, "body")
            return
        if self.cycle is not None and why == "body":
            if self.cycle.response_started:  # answered already (a 404 that did not read the body): no second answer
                self.transport.close()
                return
            self.cycle.disconnected = True  # the app's next receive() is a disconnect; its sends are dropped
            self.cycle.message_event.set()
        if why == "head":
            what = f"the request head (request line and headers) did not arrive within {self.limits.header_timeout:g} s"
        elif self.loop.time() >= self._body_deadline:
            what = f"the request body did not arrive within {self.limits.body_deadline:g} s"
        else:
            what = f"the request body made no progress for {self.limits.body_timeout:g} s"
        self._close_with(408, f"{what}; send the whole request promptly", "request_timeout")

    def _close_with(self, status: int, message: str, code: str) -> None:
        self._disarm()
        if not self.transport.is_closing():
            if not self._in_body:  # the app never got this request (past its head, the app counts it itself)
                self._count_refusal(code)
            cors = self.cors.headers_for(self._origin) if self.cors is not None else []
            self.transport.write(_refusal(status, message, code, cors))
            self.transport.close()

    # ---- send timeout -----------------------------------------------------------------------------
    def _wrote(self) -> None:
        """After each write: unsent bytes arm the watch (so every byte left in the buffer is watched, through a
        close too: asyncio's close waits for the buffer to drain, and never ends for a client that does not read)."""
        if self._send_timer is None and self._raw.get_write_buffer_size() > 0:
            self._send_taken, self._send_since = self._counting.taken, self.loop.time()
            self._send_timer = self.loop.call_later(self.limits.send_timeout / 4, self._check_send)

    def _check_send(self) -> None:
        """Every quarter of the send timeout while bytes wait: cut the connection off once the client has taken
        none of them for the whole timeout."""
        self._send_timer = None
        if self._raw.get_write_buffer_size() == 0:
            return  # all taken: the next write that leaves some arms the watch again
        now, taken = self.loop.time(), self._counting.taken
        if taken > self._send_taken:
            self._send_taken, self._send_since = taken, now
        elif now - self._send_since >= self.limits.send_timeout:
            self._stalled()
            return
        self._send_timer = self.loop.call_later(self.limits.send_timeout / 4, self._check_send)

    def _stalled(self) -> None:
        """Reset, not close: a close waits for the client to take the buffer (asyncio's, then the kernel's for
        minutes). uvicorn's connection_lost tells the app the client is gone, so a stream's engine requests are
        cancelled and their slots freed."""
        self.counter.stalled += 1
        if _sampled(self.counter.stalled):
            log.warning("reset the connection to %s: the client took none of its answer for %g s (--send-timeout); "
                        "%d reset so far", self.client, self.limits.send_timeout, self.counter.stalled)
        sock = self._raw.get_extra_info("socket")
        if sock is not None:  # linger 0: the kernel drops what it holds and sends RST, as nginx's reset_timedout_connection
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._raw.abort()

    def _count_refusal(self, code: str) -> None:
        if self.on_refusal is not None:
            self.on_refusal(REFUSAL_OUTCOMES.get(code, "invalid"))

    # ---- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        self._counting = _CountingTransport(transport, self._wrote)
        self.transport = self._counting  # type: ignore[assignment]  # what uvicorn (and its cycles) write to
        address = self.client[0] if self.client else None
        refusal = self.counter.admit(address)
        if refusal is None:
            self._admitted = True
            self._arm(self.limits.header_timeout, "head")
            return
        self._over_limit = refusal
        self.counter.refused += 1
        if _sampled(self.counter.refused):
            log.warning("refused a connection from %s (%s); %d refused so far", address, refusal[2],
                        self.counter.refused)
        self._arm(self.limits.refusal_linger, "linger")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self._admitted:
            self._admitted = False
            self.counter.release(self.client[0] if self.client else None)
        super().connection_lost(exc)

    def _answer_refused(self) -> None:
        """The refusal, once the client has begun its request (so it reads it as the answer); then the write side
        is closed and what it still sends is read and dropped until it closes or the linger ends."""
        refusal, self._over_limit = self._over_limit, None
        if refusal is not None and not self.transport.is_closing():
            self._count_refusal(refusal[2])
            self.transport.write(_refusal(*refusal))
            if self.transport.can_write_eof():
                self.transport.write_eof()
            else:
                self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._admitted:  # over a connection limit: never parsed, never reaches the app
            self._answer_refused()
            return
        self._unset_keepalive_if_required()
        if data and (self.cycle is None or self.cycle.response_complete or not self._in_body):
            self._head_started = True  # a request has begun (llhttp reports it only once the method is read)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # e.g. curl's h2c offer: the request is served as HTTP/1.1, as
            pass  # uvicorn does; what follows the head on this connection is never parsed as requests
        except httptools.HttpParserError as e:
            if self._refused is not None:
                self._close_with(*self._refused)
                return
            reason = str(e.args[0] if e.args else e)[:200]
            self.counter.malformed += 1
            if _sampled(self.counter.malformed):
                log.info("refused a malformed HTTP request from %s: %s; %d refused so far", self.client, reason,
                         self.counter.malformed)
            self._close_with(400, f"malformed HTTP/1.1 request ({reason}); {_malformed_hint(e, reason)}",
                             "malformed_http")

    # ---- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._head_count = 0
        self._origin = None
        self._head_started = True
        if self._timer is None or self._timer_why == "idle":
            self._arm(self.limits.header_timeout, "head")

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._origin is None and name.lower() == b"origin":  # read whole, even if it is the header over the limit
            self._origin = value.decode("latin-1")
        self._count(len(name) + len(value) + 4, 1)
        super().on_header(name, value)

    def _count(self, nbytes: int, nheaders: int) -> None:
        self._head_bytes += nbytes
        self._head_count += nheaders
        lim = self.limits
        if self._head_bytes > lim.max_header_bytes or self._head_count > lim.max_header_count:
            self._refused = (431, f"request headers exceed the limit of {lim.max_header_count} headers / "
                                  f"{lim.max_header_bytes} bytes; send fewer or shorter headers",
                             "headers_too_large")
            raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_started = False
        self._in_body = True
        super().on_headers_complete()
        if self.parser.get_http_version() == "1.0" and self.cycle is not None and self.cycle.scope is self.scope:
            _unframed_for_http10(self.cycle)
        self._body_deadline = self.loop.time() + self.limits.body_deadline
        self._arm_body()

    def _arm_body(self) -> None:
        delay = min(self.limits.body_timeout, max(self._body_deadline - self.loop.time(), 0.0))
        self._arm(delay, "body")

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm_body()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_body = False
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
            # answered before its body ended (a 404, a 413): uvicorn armed its keep-alive timer with the answer and
            # the body's bytes cancelled it; the connection is idle now, as after any response
            self._arm(self.limits.keep_alive_timeout, "idle")


def protocol_class(limits: HttpLimits, on_refusal: Callable[[str], None] | None = None,
                   cors: CorsSettings | None = None) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, carrying these limits and one server's counts;
    ``on_refusal`` is told the outcome of each request refused here (the server's lineside_requests_total), and
    ``cors`` (the app's) gives those refusals the CORS headers the app would."""
    limits.check()
    check_uvicorn()
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and limits.max_connections > soft - 64:
        log.info("at most %d connections (the process may open %d files; `ulimit -n` raises it)",
                 max(soft - 64, 1), soft)
        limits = replace(limits, max_connections=max(soft - 64, 1))
    counter = ConnectionCounter(limits.max_connections_per_client, limits.max_connections)
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"limits": limits, "counter": counter, "on_refusal": staticmethod(on_refusal) if on_refusal else None,
                 "cors": cors})


def uvicorn_config(app: Any, *, host: str, port: int, limits: HttpLimits, log_level: str = "info",
                   access_log: bool = False, graceful_shutdown: float = 5.0) -> uvicorn.Config:
    """The uvicorn.Config `lineside serve` and the tests' servers share: guarded httptools, no WebSockets,
    no server header (nothing to fingerprint), and the keep-alive timeout from ``limits``, announced in every answer
    (``Keep-Alive: timeout=N``, whole seconds rounded down, as Node's server sends it): Node's http.Agent and undici
    then drop an idle socket before the server does, instead of reusing one it is closing (ECONNRESET)."""
    announce = [("keep-alive", f"timeout={int(limits.keep_alive_timeout)}")]
    app_state = getattr(app, "state", None)
    metrics = getattr(getattr(app_state, "lineside", None), "metrics", None)
    http = protocol_class(limits, metrics.reject if metrics is not None else None, getattr(app_state, "cors", None))
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
                          http=http, ws="none", server_header=False, headers=announce,
                          timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=graceful_shutdown,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=limits.max_header_bytes)
