"""lineside.fleet.passthrough's HTTP/1.1 edges, over raw loopback sockets: pipelined requests answered in order,
Expect: 100-continue, an HTTP/1.0 client and a close-delimited upstream response, an upstream that closes its
kept-alive connection between requests, a malformed request."""

from __future__ import annotations

import asyncio
import json

import pytest

from lineside.fleet.passthrough import Answer, Forward, RequestHead, UpstreamPool, serve

try:
    import uvloop

    new_loop = uvloop.new_event_loop
except ImportError:
    new_loop = asyncio.new_event_loop


class FakeUpstream:
    """Answers by path: /cl (Content-Length, kept alive), /chunked (two chunks), /close (HTTP/1.0-style body
    ended by closing), /once (answers, then closes the kept-alive connection), /stream (chunked, whatever the
    request's version, as uvicorn's httptools protocol answers: one chunk, the rest once ``release`` is set)."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.connections = 0
        self.release = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            self.heads.append(head)
            n = next((int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")),
                     0)
            body = await reader.readexactly(n)
            path = head.split(b" ")[1]
            if path == b"/chunked":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                             b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
            elif path == b"/stream":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                             b"connection: keep-alive\r\n\r\n7\r\ndata: 1\r\n")
                await writer.drain()
                await self.release.wait()
                writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
            elif path == b"/close":
                writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")
                await writer.drain()
                writer.close()
                return
            else:
                answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body) + 3, b"re:" + body)
                writer.write(answer.split(b"\r\n\r\n")[0] + b"\r\n\r\n" if head.startswith(b"HEAD ") else answer)
            await writer.drain()
            if path == b"/once":
                writer.close()
                return


@pytest.fixture
def gateway():
    loop = new_loop()
    up = FakeUpstream()
    upstream = loop.run_until_complete(asyncio.start_server(up.handle, "127.0.0.1", 0))
    up_port = upstream.sockets[0].getsockname()[1]
    pool = UpstreamPool(timeout_s=30)

    def decide(head: RequestHead) -> Forward | Answer:
        if head.path == "/own":
            return Answer(200, b'{"own": true}')
        return Forward("127.0.0.1", up_port, head.headers, add_response=[(b"x-front", b"1")])  # framing: its own

    front = loop.run_until_complete(serve(decide, pool, host="127.0.0.1", port=0))
    port = front.sockets[0].getsockname()[1]

    async def exchange(raw: bytes, until_close: bool = False, expect: int = 1) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        if until_close:
            data = await asyncio.wait_for(reader.read(-1), 10)
        else:
            data = b""
            while data.count(b"HTTP/1.") < expect or not _complete(data, expect):
                chunk = await asyncio.wait_for(reader.read(65536), 10)
                if not chunk:
                    break
                data += chunk
        writer.close()
        return data

    up.loop, up.front_port = loop, port
    yield (lambda raw, **kw: loop.run_until_complete(exchange(raw, **kw))), up
    front.close()
    upstream.close()
    pool.close()
    loop.close()


def _complete(data: bytes, expect: int) -> bool:
    """Whether the last of ``expect`` responses has fully arrived (Content-Length or final chunk)."""
    last = data[data.rfind(b"HTTP/1."):]
    if b"\r\n\r\n" not in last:
        return False
    head, body = last.split(b"\r\n\r\n", 1)
    if b"transfer-encoding: chunked" in head.lower():
        return body.endswith(b"0\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return True


def post(path: bytes, body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST " + path + b" HTTP/" + version + b"\r\nhost: gw\r\ncontent-length: %d\r\n" % len(body) + extra
            + b"\r\n" + body)


def test_pipelined_requests_are_answered_in_order_on_one_upstream_connection(gateway):
    call, up = gateway
    out = call(post(b"/cl", b"one") + post(b"/chunked", b"") + post(b"/cl", b"three"), expect=3)
    first, second, third = out.split(b"HTTP/1.1 200 OK")[1:]
    assert first.endswith(b"re:one") and b"x-front: 1" in first
    assert b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n" in second  # chunked framing passed through as sent
    assert third.endswith(b"re:three") and up.connections == 1


def test_expect_continue_is_answered_by_the_front_and_not_forwarded(gateway):
    call, up = gateway
    out = call(post(b"/cl", b"body", extra=b"expect: 100-continue\r\n"), expect=2)
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") and out.endswith(b"re:body")
    assert b"expect" not in up.heads[-1].lower()


def test_an_http10_client_gets_a_close_delimited_answer_whole(gateway):
    call, up = gateway
    out = call(post(b"/close", b"", version=b"1.0"), until_close=True)
    assert out.startswith(b"HTTP/1.0 200 OK") and b"x-front: 1" in out and out.endswith(b"until the end")
    assert up.heads[-1].split(b"\r\n")[0] == b"POST /close HTTP/1.0"


@pytest.mark.parametrize("extra", [b"", b"connection: keep-alive\r\n"])
def test_a_chunked_answer_to_an_http10_client_goes_unframed_and_ends_with_the_close(gateway, extra):
    """HTTP/1.0 has no chunked coding: the client gets the body as parsed out of the chunks, each piece as it comes,
    no Transfer-Encoding, and the front closes the connection after it (even one the client asked to keep)."""
    _, up = gateway

    async def stream() -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", up.front_port)
        writer.write(post(b"/stream", b"", extra=extra, version=b"1.0"))
        first = b""
        while b"data: 1" not in first:  # the first piece arrives before the upstream sends the rest
            piece = await asyncio.wait_for(reader.read(65536), 10)
            assert piece, first
            first += piece
        up.release.set()
        rest = await asyncio.wait_for(reader.read(-1), 10)  # returns only once the front closes the connection
        writer.close()
        return first, rest

    first, rest = up.loop.run_until_complete(stream())
    head, body = first.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding" not in head.lower() and b"keep-alive" not in head.lower(), head
    assert b"connection: close" in head and b"x-front: 1" in head, head
    assert body + rest == b"data: 1data: 2", (body, rest)


def test_a_chunked_answer_to_an_http11_client_stays_chunked(gateway):
    call, up = gateway
    up.release.set()
    out = call(b"POST /stream HTTP/1.1\r\nhost: gw\r\ncontent-length: 0\r\n\r\n")
    assert b"transfer-encoding: chunked" in out.lower() and out.endswith(b"7\r\ndata: 1\r\n7\r\ndata: 2\r\n0\r\n\r\n")


def test_an_upstream_that_closes_its_kept_alive_connection_is_not_reused(gateway):
    call, up = gateway
    out = call(post(b"/once", b"a") + post(b"/cl", b"b"), expect=2)
    assert out.count(b"HTTP/1.1 200 OK") == 2 and out.endswith(b"re:b") and up.connections == 2


def test_a_head_request_ends_with_its_head(gateway):
    """A HEAD answer carries Content-Length but no body: the front must not wait for one."""
    call, _ = gateway
    out = call(b"HEAD /cl HTTP/1.1\r\nhost: gw\r\n\r\n" + post(b"/cl", b"next"), expect=2)
    assert out.count(b"HTTP/1.1 200 OK") == 2 and out.endswith(b"re:next")
    assert out.split(b"HTTP/1.1 200 OK")[1].endswith(b"content-length: 3\r\nx-front: 1\r\n\r\n")


def test_a_chunked_request_body_goes_on_whole_with_its_length(gateway):
    call, up = gateway
    out = call(b"POST /cl HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert out.endswith(b"re:abcde")
    assert b"content-length: 5" in up.heads[-1] and b"transfer-encoding" not in up.heads[-1].lower()


def test_own_answers_and_malformed_requests(gateway):
    call, _ = gateway
    out = call(b"GET /own HTTP/1.1\r\nhost: gw\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b'{"own": true}')
    out = call(b"NOT HTTP AT ALL\r\n\r\n", until_close=True)
    assert out.startswith(b"HTTP/1.1 400 Bad Request")
    error = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]  # OpenAI-shaped, valid JSON
    assert error == {"message": "malformed HTTP request", "type": "invalid_request_error", "code": "bad_request",
                     "param": None}
