"""A client that disconnects while its request body is still arriving went away; it made no invalid request: it is
counted as cancelled in lineside_requests_total, as a client that leaves while its request waits or runs is, not
as a 400 (FastAPI reports the disconnect met while reading the body as a parse error). Driven through the app's
ASGI interface with a receive() that disconnects, so the count is read when the app has answered: no polling."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.conftest import make_engine, running_server


@pytest.fixture(scope="module")
def srv(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=1)) as s:
        yield s


def _call(app, path: str, body: bytes, length: int, *, whole: bool) -> list[dict]:
    """POST ``body`` to ``path`` announcing ``length`` bytes (``whole``: the last chunk; else more was to come), then
    the client disconnects; the messages the app sent back."""
    messages = [{"type": "http.request", "body": body, "more_body": not whole}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(length).encode())]}
    asyncio.run(app(scope, receive, send))
    return sent


def _count(srv, outcome: str) -> float:
    return srv.state.metrics.registry.get_sample_value("lineside_requests_total", {"outcome": outcome}) or 0.0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_client_gone_mid_body_is_cancelled_not_invalid(srv, path):
    invalid, cancelled = _count(srv, "invalid"), _count(srv, "cancelled")
    _call(srv.app, path, b'{"prompt": "half of a bo', 60, whole=False)
    assert (_count(srv, "invalid"), _count(srv, "cancelled")) == (invalid, cancelled + 1)


def test_a_malformed_body_is_still_invalid(srv):
    invalid, cancelled = _count(srv, "invalid"), _count(srv, "cancelled")
    sent = _call(srv.app, "/v1/completions", b'{"prompt": ', 11, whole=True)
    assert sent[0]["status"] == 400
    assert (_count(srv, "invalid"), _count(srv, "cancelled")) == (invalid + 1, cancelled)
