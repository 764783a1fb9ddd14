"""Clients that stop taking their answer (issue: slow and stalled clients), on real sockets: the server's send
buffer is kept small (as a full TCP window over a real network makes it), so a client that does not read fills it
within a few tokens. A stalled stream is cut off after the send timeout with its engine requests cancelled and
their slots freed, other streams go on meanwhile, and an answer left unread after it finished does not hold its
connection forever. Waits poll the server's own counters (the connection counts, the engine's outcomes)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from lineside.runtime.request import FinishReason
from lineside.server import sse
from lineside.server.app import create_app
from lineside.server.http_limits import HttpLimits, uvicorn_config
from tests.server.conftest import make_engine

LIMITS = HttpLimits(send_timeout=2.0, keep_alive_timeout=0.5)
WAIT = 60.0  # seconds: a bound on waiting for an event, never a measured duration


def _until(cond: Callable[[], bool], what: str) -> None:
    """Poll the server's state until ``cond`` holds (the event happened), failing after WAIT: uvicorn runs in a
    thread of its own and announces none of these states (a paused write, a reset, an empty slot) as an event."""
    deadline = time.monotonic() + WAIT
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


@contextmanager
def small_buffer_server(engine, limits: HttpLimits = LIMITS) -> Iterator[tuple[uvicorn.Server, int]]:
    """The app under `lineside serve`'s protocol on a listening socket whose accepted connections have a 4 KiB
    kernel send buffer (inherited from the listener), so a client that stops reading stalls the server at once."""
    app = create_app(engine)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, limits=limits, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        _until(lambda: server.started, "the server started")
        _until(lambda: httpx.get(f"http://127.0.0.1:{port}/health/ready").status_code == 200, "the model loaded")
        server.app_state = app.state.lineside  # type: ignore[attr-defined]
        yield server, port
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


def _silent_client(port: int, body: dict) -> socket.socket:
    """Sends a request and never reads: its receive window (4 KiB) fills and stays full."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def _connections(server: uvicorn.Server):
    return server.config.http_protocol_class.counter


def _held(server: uvicorn.Server) -> int:
    """Bytes the server holds for its clients that the kernel has not taken (a client not reading fills this)."""
    return sum(c.transport.get_write_buffer_size() for c in server.server_state.connections)


def _outcomes(server: uvicorn.Server) -> dict[FinishReason, int]:
    return dict(server.app_state.engine.stats().requests)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "ignore_eos": True}


def test_a_stream_whose_client_stops_reading_is_cut_off_and_its_slots_freed(tiny_bundle):
    # 0.05 s a step: the stalled request's 200 tokens would take 10 s, far past the stall and its 2 s timeout
    with small_buffer_server(make_engine(tiny_bundle, num_slots=4, delay=0.05)) as (server, port):
        conns = _connections(server)
        stalled = _silent_client(port, {**CHAT, "max_tokens": 200, "n": 2, "logprobs": True, "top_logprobs": 20})
        try:
            _until(lambda: any(c.flow.write_paused for c in server.server_state.connections),
                   "the server's buffer for the silent client filled")
            # meanwhile another client's stream is served whole
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=WAIT,
                              json={**CHAT, "max_tokens": 8}) as r:
                events = sse.parse(r.read().decode())
            assert r.status_code == 200 and events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            _until(lambda: conns.stalled == 1, "the stalled connection was cut off")
            _until(lambda: conns.open == 0, "the stalled connection was released")
            _until(lambda: server.app_state.engine.stats().running == 0, "the stalled stream's slots were freed")
            # its two choices were cancelled before their 200 tokens, not generated to the end for nobody
            assert _outcomes(server) == {FinishReason.LENGTH: 1, FinishReason.CANCELLED: 2}
            stalled.settimeout(WAIT)
            with pytest.raises(ConnectionResetError):  # aborted: what it had not read is gone
                while stalled.recv(65536):
                    pass
        finally:
            stalled.close()


def test_an_answer_left_unread_after_it_finished_does_not_hold_its_connection(tiny_bundle):
    """The whole answer fits the server's buffers below the point writing pauses: the request ends, the keep-alive
    timeout closes the connection, and that close waited for the client to read it, forever."""
    with small_buffer_server(make_engine(tiny_bundle, num_slots=2)) as (server, port):
        conns = _connections(server)
        silent = _silent_client(port, {**CHAT, "max_tokens": 200})
        try:
            _until(lambda: _outcomes(server) == {FinishReason.LENGTH: 1}, "the request was generated whole")
            assert 0 < _held(server) < 65536  # left in the buffer, below where writing pauses
            _until(lambda: conns.open == 0, "the unread connection was released")
            assert conns.stalled == 1
        finally:
            silent.close()


def test_a_client_reading_slowly_but_steadily_gets_its_whole_stream(tiny_bundle):
    with small_buffer_server(make_engine(tiny_bundle, num_slots=2)) as (server, port):
        conns = _connections(server)
        s = _silent_client(port, {**CHAT, "max_tokens": 100, "logprobs": True, "top_logprobs": 5})
        s.settimeout(WAIT)
        got, waited = bytearray(), 0
        try:
            while not got.endswith(b"0\r\n\r\n"):  # the chunked body's end
                # the next KiB only once the server holds bytes it cannot send (this client is what it waits on) or
                # the answer is whole: slower than the stream at every read, never silent for the send timeout
                _until(lambda: _outcomes(server) or _held(server), "the server waited on the slow reader")
                waited += bool(_held(server))
                chunk = s.recv(1024)
                assert chunk, got[-300:]
                got.extend(chunk)
        finally:
            s.close()
        assert b"data: [DONE]" in got and conns.stalled == 0 and waited > 0  # the client was what the server waited on
        assert _outcomes(server) == {FinishReason.LENGTH: 1}


def test_send_timeout_must_be_positive():
    with pytest.raises(ValueError, match="send_timeout"):
        HttpLimits(send_timeout=0).check()
