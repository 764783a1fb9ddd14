"""HTTP/1.1 connection hygiene under uvicorn: the parser is httptools (llhttp, Node.js's parser), which
already refuses Content-Length together with Transfer-Encoding and malformed or overflowing chunk sizes;
this subclass adds what no stack we measured does (benchmarks/http_stacks.py): a deadline for the
request head, a header count and size limit, a body-progress timeout, and OpenAI-shaped refusals that
close the connection, so nothing after a bad message is ever parsed as a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lineside.server.errors import APIError

log = logging.getLogger("lineside.server")


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits; seconds for timeouts, bytes for sizes."""

    header_timeout: float = 10.0  # from connection (or the end of the last response) to the end of the head
    body_timeout: float = 10.0  # longest pause between two pieces of a request body
    body_deadline: float = 120.0  # whole body, however steadily it trickles
    keep_alive_timeout: float = 5.0  # idle keep-alive connection between requests
    max_header_bytes: int = 16 * 1024  # request line + all header lines
    max_header_count: int = 100

    def check(self) -> None:
        for name in ("header_timeout", "body_timeout", "body_deadline", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("max_header_bytes", "max_header_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def _refusal(status: int, message: str, code: str) -> bytes:
    body = json.dumps(APIError(status, message, code).body()).encode()
    reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body))) + body


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing; httptools re-raises it wrapped in HttpParserError."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body deadlines and header limits (see HttpLimits)."""

    limits: HttpLimits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_count = 0
        self._head_started = False
        self._refused: tuple[int, str, str] | None = None
        self._body_deadline = 0.0
        self._in_body = False

    # ---- timers ---------------------------------------------------------------------------------
    def _arm(self, delay: float, why: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, self._expired, why)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, why: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if why == "head" and not self._head_started:  # an idle connection that never began a request
            self.transport.close()
            return
        if why == "body" and self.flow.read_paused:  # the app has not read what came: not the client's fault
            self._arm(self.limits.body_timeout, "body")
            return
        if self.cycle is not None and not self.cycle.response_complete and why == "body":
            if self.cycle.response_started:
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
            self.transport.write(_refusal(status, message, code))
            self.transport.close()

    # ---- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout, "head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
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
            log.info("refused a malformed HTTP request from %s: %s", self.client, reason)
            self._close_with(400, f"malformed HTTP/1.1 request ({reason}); send one framing (Content-Length or "
                                  "chunked Transfer-Encoding) and valid chunk sizes", "malformed_http")

    # ---- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._head_count = 0
        self._head_started = True
        if self._timer is None:
            self._arm(self.limits.header_timeout, "head")

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
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


def protocol_class(limits: HttpLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, carrying these limits."""
    limits.check()
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


def uvicorn_config(app: Any, *, host: str, port: int, limits: HttpLimits, log_level: str = "info",
                   access_log: bool = False, graceful_shutdown: float = 5.0) -> uvicorn.Config:
    """The uvicorn.Config `lineside serve` and the tests' servers share: guarded httptools, no WebSockets,
    no server header (nothing to fingerprint), and the keep-alive timeout from ``limits``."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
                          http=protocol_class(limits), ws="none", server_header=False,
                          timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=graceful_shutdown,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=limits.max_header_bytes)
