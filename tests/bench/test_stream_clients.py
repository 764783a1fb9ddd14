"""benchmarks/stream_clients.py: the lean client (one thread, llhttp) reads what the stdlib client reads — from a real
`lineside serve` app, from a server that dribbles its chunked SSE body a few bytes at a time, and from an error."""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.stream_clients import CLIENTS  # noqa: E402
from tests.server.conftest import running_server  # noqa: E402

PROMPTS = ["Once upon a time", "The three laws of", "Here is a recipe", "A list of the planets"]


@pytest.fixture(scope="module")
def served(tiny_bundle):
    with running_server(tiny_bundle, num_slots=4, threads=1) as srv:
        yield srv


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_concurrent_streams_read_what_one_at_a_time_reads(served, client):
    one, many = CLIENTS[client]
    model = served.state.engine.model_name
    alone = [CLIENTS["stdlib"][0](served.url, model, p, 12) for p in PROMPTS]
    wall, streams = many(served.url, model, PROMPTS, 12)
    assert [s.text for s in streams] == [s.text for s in alone] and all(s.text for s in streams)
    assert all(s.tokens == 12 and s.finish_reason == "length" for s in streams)
    assert all(0 < s.ttft_s <= s.end_s <= wall for s in streams)
    assert one(served.url, model, PROMPTS[0], 12).text == alone[0].text


def _dribbling_server(events: list[bytes], status: int = 200) -> tuple[str, threading.Thread]:
    """An HTTP/1.1 server answering one request with ``events`` as a chunked SSE body, sent 3 bytes at a time."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            request = b""
            while b"\r\n\r\n" not in request:  # the whole request, or closing would reset the connection
                request += conn.recv(65536)
            request_head, _, body = request.partition(b"\r\n\r\n")
            length = int(request_head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += conn.recv(65536)
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
            reason = b"OK" if status == 200 else b"Bad Request"
            head = (b"HTTP/1.1 %d %s\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    % (status, reason))
            data = head + chunks
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                for i in range(0, len(data), 3):
                    conn.sendall(data[i:i + 3])
            except (BrokenPipeError, ConnectionResetError):
                pass  # a client may hang up once it has read [DONE]

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"http://127.0.0.1:{port}", t


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_events_split_anywhere_are_put_back_together(client):
    words = ["Hel", "lo", " wor", "ld\n", "!"]
    events = [_sse({"choices": [{"text": w, "finish_reason": None}]}) for w in words]
    events += [_sse({"choices": [{"text": "", "finish_reason": "length"}]}),
               _sse({"choices": [], "usage": {"completion_tokens": 5}}), b"data: [DONE]\n\n"]
    url, t = _dribbling_server(events)
    s = CLIENTS[client][0](url, "m", "p", 5)
    t.join(5)
    assert (s.text, s.chunks, s.tokens, s.finish_reason) == ("Hello world\n!", 5, 5, "length")


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_an_error_answer_is_one_line_with_its_status(client):
    url, t = _dribbling_server([b'{"error": {"message": "no such model"}}'], status=400)
    with pytest.raises(RuntimeError, match="answered 400: .*no such model"):
        CLIENTS[client][0](url, "m", "p", 5)
    t.join(5)
