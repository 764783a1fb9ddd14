"""The middleware's in-flight count (what a drain waits for and /metrics' lineside_http_requests_in_flight shows)
covers every route that runs a generation, and those routes are refused while draining, without a model."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from lineside.server.metrics import ServerMetrics
from lineside.server.middleware import ServerMiddleware
from lineside.server.state import ServerState

GENERATING = ["/v1/chat/completions", "/v1/completions", "/v1/prefill", "/v1/responses"]


def _state() -> ServerState:
    engine = SimpleNamespace(ready=True, model_name="m")
    state = ServerState(engine, {}, ServerMetrics(), request_timeout=None, drain_timeout=1.0, api_key=None)
    state.ready = True
    return state


def _call(state: ServerState, path: str, method: str = "POST") -> tuple[list[int], list[dict]]:
    """POST ``path`` through the middleware; (in-flight counts the inner app saw, messages sent back)."""
    seen, sent = [], []

    async def app(scope, receive, send):
        seen.append(state.inflight)
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-type", b"application/json")]}
    asyncio.run(ServerMiddleware(app, state, max_body_bytes=1 << 20)(scope, receive, send))
    return seen, sent


@pytest.mark.parametrize("path", GENERATING)
def test_generation_routes_count_in_flight(path):
    state = _state()
    seen, sent = _call(state, path)
    assert seen == [1] and sent[0]["status"] == 200  # counted while it ran: a drain waits for it
    assert state.inflight == 0 and state.metrics.http_inflight._value.get() == 0


@pytest.mark.parametrize("path", [p for p in GENERATING if p != "/v1/prefill"])  # prefill: 409, its own test
def test_generation_routes_refused_while_draining(path):
    state = _state()
    state.draining = True
    seen, sent = _call(state, path)
    assert seen == [] and sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "draining"


def test_reads_are_not_counted():
    state = _state()
    seen, _ = _call(state, "/v1/responses/resp_1", "DELETE")
    assert seen == [0]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenize_routes_wait_for_the_model_and_the_drain_waits_for_them(path):
    """They read the loaded tokenizer (503 until it is there) and must not outlive the tokenizer worker a drain
    ends with, so they count in flight and are refused once the drain starts, as the generation routes."""
    state = _state()
    seen, sent = _call(state, path)
    assert seen == [1] and sent[0]["status"] == 200
    state.ready = False
    seen, sent = _call(state, path)
    assert seen == [] and sent[0]["status"] == 503 and json.loads(sent[1]["body"])["error"]["code"] == "not_ready"
    state.ready, state.draining = True, True
    seen, sent = _call(state, path)
    assert seen == [] and sent[0]["status"] == 503
