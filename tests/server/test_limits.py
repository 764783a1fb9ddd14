"""Each limit: queue full → 429 + Retry-After, request timeout, over-long prompt → 400 with the numbers,
API key → 401, loading/draining → 503, and a client that leaves (streaming or not) frees its slot."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import make_engine, metric, running_server

SLOW = 0.02  # seconds per model step


def _wait(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def slow_server(tiny_bundle):
    """One slot, one waiting place, 20 ms per step: a long request holds the slot for seconds."""
    with running_server(make_engine(tiny_bundle, num_slots=1, max_waiting=1, delay=SLOW)) as srv:
        yield srv


def _stats(srv):
    return srv.state.engine.stats()


def test_queue_full_is_429_with_retry_after(slow_server):
    url = slow_server.url + "/v1/completions"
    body = {"prompt": "long", "max_tokens": 200, "temperature": 0}

    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            first = asyncio.create_task(c.post(url, json=body))  # takes the slot
            await asyncio.sleep(0.3)
            second = asyncio.create_task(c.post(url, json=body))  # the one waiting place
            await asyncio.sleep(0.3)
            third = await c.post(url, json={**body, "max_tokens": 2})
            for t in (first, second):
                t.cancel()
            await asyncio.gather(first, second, return_exceptions=True)
            return third

    r = asyncio.run(go())
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    assert err["message"].count("retry") == 1 and "\n" not in err["message"], err["message"]
    # the cancelled clients free the slot and the queue
    assert _wait(lambda: _stats(slow_server).running == 0 and _stats(slow_server).waiting == 0)
    text = httpx.get(slow_server.url + "/metrics").text
    assert metric(text, "lineside_requests_total", 'outcome="queue_full"') >= 1


def test_nonstreaming_disconnect_cancels(slow_server):
    before = _stats(slow_server).requests.get("cancelled", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", json={"prompt": "bye", "max_tokens": 200, "temperature": 0},
                   timeout=0.3)
    assert _wait(lambda: _stats(slow_server).requests.get("cancelled", 0) > before, 3.0)
    assert _stats(slow_server).running == 0


def test_streaming_disconnect_frees_slot_in_metrics(slow_server):
    url = slow_server.url
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "temperature": 0,
                            "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # role chunk + a few tokens
            assert got[0].startswith("data: ")
            m = c.get(url + "/metrics").text
            assert metric(m, "lineside_num_requests_running") == 1
            cancelled = metric(m, "lineside_requests_total", 'outcome="cancelled"')
        # leaving the block closes the connection mid-stream

    def freed():
        m = httpx.get(url + "/metrics").text
        return (metric(m, "lineside_num_requests_running") == 0
                and metric(m, "lineside_requests_total", 'outcome="cancelled"') == cancelled + 1)

    assert _wait(freed, 3.0)
    # and the slot serves the next request at once
    r = httpx.post(url + "/v1/completions", json={"prompt": "next", "max_tokens": 3, "temperature": 0}, timeout=10)
    assert r.status_code == 200


def test_request_timeout(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=1, delay=SLOW), request_timeout=0.3) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "t", "max_tokens": 200, "temperature": 0},
                       timeout=10)
        assert r.status_code == 408, r.text
        err = r.json()["error"]
        assert err["code"] == "request_timeout" and "0.3" in err["message"]
        assert r.headers["x-should-retry"] == "false"
        with pytest.raises(openai.APIStatusError) as e:  # not retried
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=2).completions.create(
                model="tiny-llama", prompt="t", max_tokens=200, temperature=0)
        assert e.value.status_code == 408
        # streaming: the stream ends with an error event the openai client raises on
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="timeout"):
            for _ in c.completions.create(model="tiny-llama", prompt="t", max_tokens=200, temperature=0, stream=True):
                pass
        short = httpx.post(srv.url + "/v1/completions", json={"prompt": "t", "max_tokens": 3, "temperature": 0})
        assert short.status_code == 200
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "lineside_requests_total", 'outcome="timeout"') == 3  # 3, not 5: no retries


def test_overlong_prompt_gives_numbers(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 300, "max_tokens": 4})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "301 tokens" in msg and "256" in msg  # BOS + 300 bytes
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "y" * 200}], "max_tokens": 100})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "+ max_tokens (100)" in err["message"] and "256" in err["message"]


def test_the_overlong_prompt_of_several_is_named(server):
    """A list of prompts with one past the context: the 400 names which ("prompt.1"), as a text check, as token ids,
    and as a prompt that fits but leaves no room for max_tokens; a lone prompt stays "prompt"."""
    for prompts, param in ((["short", "x" * 300], "prompt.1"), ([[5] * 300, [6]], "prompt.0"),
                           (["a", "b", "x" * 255], "prompt.2"), ("x" * 300, "prompt")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompts, "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "\n" not in err["message"], r.text


def test_api_key(tiny_bundle, monkeypatch):
    with running_server(make_engine(tiny_bundle, num_slots=1), api_key="s3cret") as srv:
        body = {"prompt": "k", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(srv.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="tiny-llama", prompt="k", max_tokens=2).usage.completion_tokens >= 1
        # without the key only the probes answer; everything else, /metrics included, is a 401
        for path in ("/health", "/health/ready"):
            assert httpx.get(srv.url + path).status_code == 200, path
        for path in ("/metrics", "/health/gpu", "/v1/models", "/openapi.json", "/docs", "/redoc", "/nothing"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    with running_server(make_engine(tiny_bundle, num_slots=1), api_key="s3cret", metrics_public=True,
                        openapi=True) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 200  # --metrics-public
        assert httpx.get(srv.url + "/openapi.json").status_code == 401  # the schema stays behind the key
        r = httpx.get(srv.url + "/openapi.json", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]
        for path in ("/docs", "/redoc"):  # no HTML pages loading scripts from a CDN, even with the schema on
            assert httpx.get(srv.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 404


def test_ready_503_while_loading_and_draining(tiny_bundle):
    from lineside.bench.inprocess import BackgroundServer
    from lineside.server.app import create_app

    eng = make_engine(tiny_bundle, num_slots=1, delay=SLOW)
    start = eng.start
    gate = asyncio.Event()

    async def slow_start():
        await gate.wait()
        await start()

    eng.start = slow_start
    app = create_app(eng)
    srv = BackgroundServer(app, ready_path="/health", startup_timeout=30).start()
    try:
        r = httpx.get(srv.url + "/health/ready")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        state = app.state.lineside  # let the engine start now (the gate lives on the server's loop)
        loop = state._load_task.get_loop()
        loop.call_soon_threadsafe(gate.set)
        assert _wait(lambda: httpx.get(srv.url + "/health/ready").status_code == 200, 10)
        assert httpx.get(srv.url + "/health/ready").json()["ready_after_s"] > 0  # process start -> ready

        async def drain_during_request():
            async with httpx.AsyncClient(timeout=30) as c:
                inflight = asyncio.create_task(c.post(srv.url + "/v1/completions",
                                                      json={"prompt": "d", "max_tokens": 30, "temperature": 0}))
                await asyncio.sleep(0.2)
                done = threading.Event()
                fut = asyncio.run_coroutine_threadsafe(state.drain(10), loop)
                fut.add_done_callback(lambda _f: done.set())
                await asyncio.sleep(0.05)
                refused = await c.post(srv.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
                ready = await c.get(srv.url + "/health/ready")
                first = await inflight
                await asyncio.to_thread(done.wait, 10)
                return refused, ready, first, fut.result()

        refused, ready, first, drained = asyncio.run(drain_during_request())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert drained is True
    finally:
        srv.stop()


def test_more_choices_than_the_server_can_ever_hold_is_a_400_not_a_429(slow_server):
    """n × prompts beyond slots + waiting places (here 1 + 1) can never be admitted, even on an idle server: a 429
    ("retry later") sent the openai client into retries that could not succeed; a 400 says what to change."""
    assert _wait(lambda: _stats(slow_server).running == 0 and _stats(slow_server).waiting == 0)
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 3}),
                       ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "n": 3})):
        r = httpx.post(slow_server.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == ("n" if "n" in body else "prompt")
        assert "3" in err["message"] and "2" in err["message"] and "\n" not in err["message"], err["message"]
    ok = httpx.post(slow_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text
    assert _wait(lambda: _stats(slow_server).running == 0 and _stats(slow_server).waiting == 0)


TOOL = {"type": "function", "function": {"name": "lookup", "description": "d" * 400,
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def _context_400(r, param: str) -> str:
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, r.text
    assert "\n" not in err["message"]
    return err["message"]


def test_a_prompt_over_the_context_by_its_tools_says_so(server):
    """A short chat whose tools' schemas fill the context: the 400 says the tools count and may be cut (as OpenAI's
    error counts tokens "in the functions"), on each route that renders tools, tool_choice none included; without
    tools the 400 is about the messages alone."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "max_tokens": 4}
    msg = _context_400(httpx.post(server.url + "/v1/chat/completions", json=chat), "messages")
    assert "'messages' with the 1 tool rendered into the prompt" in msg and "fewer or shorter tools" in msg, msg
    msg = _context_400(httpx.post(server.url + "/v1/prefill", json={**chat, "session_id": "tools"}), "messages")
    assert "1 tool rendered into the prompt" in msg and "fewer or shorter tools" in msg, msg
    flat = {k: v for k, v in TOOL["function"].items()}
    resp = {"input": "hi", "tools": [{"type": "function", **flat}, {"type": "function", **flat, "name": "again"}]}
    msg = _context_400(httpx.post(server.url + "/v1/responses", json=resp), "input")
    assert "'input' with the 2 tools rendered into the prompt" in msg and "fewer or shorter tools" in msg, msg
    # tool_choice none still renders them (as vLLM and OpenAI): they count
    msg = _context_400(httpx.post(server.url + "/v1/chat/completions", json={**chat, "tool_choice": "none"}), "messages")
    assert "'messages' with the 1 tool rendered into the prompt" in msg, msg
    unlisted = httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "y" * 300}], "max_tokens": 4})
    msg = _context_400(unlisted, "messages")
    assert "tool" not in msg, msg
