"""The gateway front alone (no smg needed): header → pool, sessions, shadow copies, streaming relay.

Each pool's "router" is a small OpenAI-shaped app on a loopback port, answering which pool it is and echoing
the session header it received; the front is a real server on loopback (lineside.fleet.passthrough) in this
module's event loop, called over TCP.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lineside.bench.inprocess import BackgroundServer, free_port
from lineside.fleet.front import Front, ShareSampler, answer_text, sse_text
from lineside.fleet.front_config import FrontConfig, ShadowSpec

HANG_CLOSED = threading.Event()  # a pool's never-ending stream (/v1/hang) was closed by its client


def pool_app(name: str, seen: list[dict]) -> Starlette:
    async def chat(request: Request):
        body = await request.json()
        seen.append({"pool": name, "headers": dict(request.headers), "body": body})
        text = f"answer from {name}" if name != "candidate-same" else "answer from realtime"
        if body.get("stream"):
            async def gen():
                for w in text.split(" "):
                    yield f"data: {json.dumps({'choices': [{'delta': {'content': w + ' '}}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream", headers={"x-pool": name})
        degraded = {"x-lineside-degraded": "1"} if name == "batch" else {}  # a node on its SLO ladder's level 1
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": text}}]},
                            headers={"x-pool": name, "x-session-seen": request.headers.get("x-session-id", ""),
                                     **degraded})

    async def hang(request: Request):
        """One token, then a generation that never ends: only the client going away ends it."""
        async def gen():
            try:
                yield 'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
                await asyncio.Event().wait()
            finally:
                seen.append({"pool": name, "hang": "closed"})
                HANG_CLOSED.set()
        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/hang", hang, methods=["POST"]),
                             Route("/health", lambda r: JSONResponse({"ok": True})),
                             Route("/readiness", lambda r: JSONResponse({"status": "ready"}))])


# SMG 1.13's answer to a request whose model no registered worker serves, byte for byte
SMG_NO_WORKER = (b'{"error":{"type":"invalid_request_error","code":"model_not_found",'
                 b'"message":"No worker available for model \'m\'","param":null}}')


def router_without_workers(ready: bool = False) -> Starlette:
    """What an SMG router answers when no worker of its pool is healthy: alive (/health 200), not ready; and
    SMG's 404 model_not_found to a request (also its answer to an unknown model when workers are ready)."""
    def no_worker(r: Request) -> Response:
        return Response(SMG_NO_WORKER, 404, media_type="application/json")

    return Starlette(routes=[Route("/health", lambda r: JSONResponse({"ok": True})),
                             Route("/v1/chat/completions", no_worker, methods=["POST"]),
                             Route("/readiness", lambda r: JSONResponse(
                                 {"status": "ready"} if ready else
                                 {"status": "not ready", "reason": "insufficient healthy workers"},
                                 200 if ready else 503))])


@pytest.fixture(scope="module")
def upstreams():
    """The three pools' "routers": real HTTP servers on loopback (the front's aiohttp pool talks to them)."""
    seen: list[dict] = []
    servers = {n: BackgroundServer(pool_app(n, seen), ready_path="/health").start()
               for n in ("realtime", "batch", "candidate-same")}
    yield {n: s.url for n, s in servers.items()}, seen
    for s in servers.values():
        s.stop()


try:  # the loop `lineside fleet gateway` serves the front on (uvloop's transports differ from asyncio's)
    import uvloop

    _LOOP = uvloop.new_event_loop()
except ImportError:
    _LOOP = asyncio.new_event_loop()  # one loop for the module: a front's connections live in one loop


def run(coro):
    return _LOOP.run_until_complete(coro)


@pytest.fixture
def make(upstreams):
    urls, seen = upstreams
    fronts: list[Front] = []

    listeners = []

    def build(shadow_to: str = "batch", share: float = 0.5, body_priority_pools: frozenset[str] = frozenset()):
        seen.clear()
        cfg = FrontConfig(pools=dict(urls), default_pool="realtime", session_idle_s=90,
                          shadow=ShadowSpec("realtime", shadow_to, share), body_priority_pools=body_priority_pools)
        front = Front(cfg)
        port = free_port("127.0.0.1")
        listeners.append(run(front.serve("127.0.0.1", port)))
        front.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        fronts.append(front)
        return front, seen

    yield build
    for listener in listeners:
        listener.close()
    for f in fronts:
        run(f.aclose())


async def _call(front: Front, headers: dict | None = None, stream: bool = False, cookies: dict | None = None,
                extra: dict | None = None):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **(extra or {})}
    async with httpx.AsyncClient(base_url=front.url, cookies=cookies, trust_env=False, timeout=10) as c:
        r = await c.post("/v1/chat/completions", json=body, headers=headers or {})
        await front.drain_shadow()
        return r


def test_header_picks_the_pool(make):
    front, seen = make(share=0.0001)
    for headers, pool in (({"X-Mode": "realtime"}, "realtime"), ({"X-Mode": "BATCH"}, "batch"),
                          ({"X-Batch": "true"}, "batch"), ({}, "realtime")):
        r = run(_call(front, headers))
        assert r.status_code == 200 and r.headers["x-pool"] == pool
        assert r.headers.get("x-lineside-degraded") == ("1" if pool == "batch" else None)  # passed back as sent
    r = run(_call(front, {"X-Mode": "bulk"}))
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "X-Mode 'bulk' is not a pool of this gateway; use one of: realtime, "
                                            "batch, candidate-same", "type": "invalid_request_error",
                                 "code": "unknown_pool", "param": "X-Mode"}


def test_sessions_become_the_routing_key(make):
    front, seen = make(share=0.0001)
    r = run(_call(front, {"X-Session-Id": "station-7"}))
    assert r.headers["x-session-seen"] == "station-7" and "set-cookie" not in r.headers
    r = run(_call(front, cookies={"lineside_session": "abc123"}))
    assert r.headers["x-session-seen"] == "abc123" and "set-cookie" not in r.headers
    r = run(_call(front))  # neither: a new id, sent upstream and set as a cookie for the next request
    sid = r.headers["x-session-seen"]
    assert len(sid) == 32 and r.headers["set-cookie"] == (
        f"lineside_session={sid}; Max-Age=90; Path=/; HttpOnly; SameSite=Lax")


def test_priority_becomes_smg_admission_class(make):
    front, seen = make(share=0.0001)
    run(_call(front, {"X-Priority": "high", "X-SMG-Priority": "system"}))
    run(_call(front, {"X-Priority": "LOW"}))
    run(_call(front, {"X-SMG-Priority": "system"}))  # a client cannot pick SMG's class itself
    assert [s["headers"].get("x-smg-priority") for s in seen] == ["interactive", "bulk", None]
    assert seen[0]["headers"]["x-priority"] == "high"  # passed on as well
    r = run(_call(front, {"X-Priority": "urgent"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Priority" and len(seen) == 3


def test_the_request_class_reaches_the_nodes_in_tracestate(make):
    """SMG forwards tracestate but not X-Priority / X-Mode: the front writes both into its lineside member."""
    front, seen = make(share=0.0001)
    run(_call(front, {"X-Priority": "high", "X-Mode": "batch", "tracestate": "rojo=00f0,lineside=priority:low"}))
    run(_call(front, {"X-Priority": "low"}))  # the default pool, realtime
    run(_call(front, {"X-Mode": "candidate-same"}))  # a pool that is no node mode, no priority: nothing to carry
    assert [s["headers"].get("tracestate") for s in seen] == [
        "lineside=priority:high;mode:batch,rojo=00f0", "lineside=priority:low;mode:realtime", None]
    # the bodies passed byte for byte: no priority field where the pool has no vLLM/SGLang member
    assert all("priority" not in s["body"] for s in seen)


def test_vllm_sglang_pools_get_the_priority_in_the_body(make):
    front, seen = make(share=0.0001, body_priority_pools=frozenset({"batch", "realtime"}))
    run(_call(front, {"X-Priority": "high"}))
    run(_call(front, {"X-Mode": "batch"}))
    run(_call(front, {"X-Mode": "batch", "X-Priority": "low"}))
    run(_call(front, {}))  # realtime, normal: the engines' default 0, body untouched
    run(_call(front, {"X-Priority": "high"}, extra={"priority": 5}))  # the client's own value is kept
    assert [s["body"].get("priority") for s in seen] == [-1, 10, 11, None, 5]
    assert all(s["body"]["messages"] == [{"role": "user", "content": "hi"}] for s in seen)


def test_shadow_copies_share_is_exact_and_responses_are_discarded(make):
    front, seen = make(share=0.25)
    answers = [run(_call(front, {"X-Mode": "realtime"})).json() for _ in range(8)]
    assert all(a["choices"][0]["message"]["content"] == "answer from realtime" for a in answers)
    copies = [s for s in seen if s["headers"].get("x-lineside-shadow") == "1"]
    assert len(copies) == 2 and {c["pool"] for c in copies} == {"batch"}
    st = front.shadow_stats.to_dict()
    assert st["sent"] == 2 and st["completed"] == 2 and st["agreed"] == 0 and st["agreement"] == 0.0
    assert 0 < st["mean_similarity"] < 1
    run(_call(front, {"X-Mode": "batch"}))  # other pools are not mirrored
    assert front.shadow_stats.sent == 2


def test_streamed_answers_are_relayed_and_compared(make):
    front, seen = make(shadow_to="candidate-same", share=1.0)
    r = run(_call(front, {"X-Mode": "realtime"}, stream=True))
    assert r.status_code == 200 and sse_text([r.content]) == "answer from realtime "
    st = front.shadow_stats.to_dict()
    assert st["completed"] == 1 and st["agreed"] == 1 and st["mean_similarity"] == 1.0


def test_unreachable_pool_router_is_a_502_and_a_failed_shadow_is_counted(make):
    front, _ = make(share=1.0)
    front.cfg.pools["batch"] = "http://127.0.0.1:1"  # nothing listens there: the copy fails

    r = run(_call(front, {"X-Mode": "realtime"}))
    assert r.status_code == 200 and front.shadow_stats.failed == 1
    front.cfg.pools["realtime"] = "http://127.0.0.1:1"
    r = run(_call(front, {"X-Mode": "realtime"}))
    assert r.status_code == 502 and r.json()["error"]["code"] == "pool_unreachable"


def test_a_client_that_leaves_mid_stream_ends_the_upstream_generation(make):
    """The client disconnects after the first token, and the node's stream (behind the front) is closed too
    instead of generating for nobody."""
    front, seen = make(share=0.0001)
    HANG_CLOSED.clear()

    async def leave_after_first_token() -> None:
        async with httpx.AsyncClient(base_url=front.url, trust_env=False, timeout=10) as c:
            async with c.stream("POST", "/v1/hang", json={"stream": True}) as r:
                assert r.status_code == 200 and b'"x"' in await r.aiter_raw().__anext__()
        await asyncio.to_thread(HANG_CLOSED.wait, 10)

    run(leave_after_first_token())
    assert {"pool": "realtime", "hang": "closed"} in seen


def test_own_endpoints_and_keep_alive_framing(make):
    """The front's own /fleet/* answers; several requests, streamed and not, over one kept-alive client
    connection and the front's kept-alive upstream connection, each response framed right."""
    front, _ = make(shadow_to="candidate-same", share=1.0)

    async def go():
        async with httpx.AsyncClient(base_url=front.url, trust_env=False, timeout=10) as c:
            for i in range(4):
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": i % 2 == 1}
                r = await c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "s"})
                assert r.status_code == 200 and "answer from realtime" in (sse_text([r.content]) or r.text)
            await front.drain_shadow()
            shadow = (await c.get("/fleet/shadow")).json()
            metrics = (await c.get("/fleet/metrics")).text
            health = await c.get("/fleet/health")
            missing = await c.get("/fleet/nothing")
            posted = await c.post("/fleet/shadow")
        return shadow, metrics, health, missing, posted

    shadow, metrics, health, missing, posted = run(go())
    assert shadow["sent"] == shadow["completed"] == shadow["agreed"] == 4
    assert 'lineside_fleet_requests_total{pool="realtime",status="2xx"} 4.0' in metrics
    assert health.status_code == 200 and health.json()["pools"] == {
        "realtime": True, "batch": True, "candidate-same": True}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert posted.status_code == 405 and set(posted.json()["error"]) == {"message", "type", "code", "param"}


def test_fleet_health_says_which_pools_have_no_healthy_node(upstreams):
    """SMG's /health is its own liveness and answers 200 with every worker down; /fleet/health must say the
    pool cannot serve (its router's /readiness), and 503 when no pool can."""
    urls, _ = upstreams
    empty = [BackgroundServer(router_without_workers(), ready_path="/health").start() for _ in range(2)]
    try:
        async def health(pools: dict[str, str]):
            front = Front(FrontConfig(pools=pools, default_pool=next(iter(pools))))
            try:
                return await front.health()
            finally:
                await front.aclose()

        some = run(health({"realtime": urls["realtime"], "batch": empty[0].url}))
        none = run(health({"realtime": empty[0].url, "batch": empty[1].url}))
    finally:
        for s in empty:
            s.stop()
    assert some.status == 200 and json.loads(some.body) == {"status": "degraded",
                                                             "pools": {"realtime": True, "batch": False}}
    assert none.status == 503 and json.loads(none.body)["pools"] == {"realtime": False, "batch": False}


def test_a_pool_with_no_node_registered_is_a_503_not_a_wrong_model(upstreams):
    """SMG answers 404 model_not_found while none of its pool's nodes has passed a health check (a gateway started
    during an outage): the client would take its model name for wrong and not retry. The front answers 503
    no_ready_node there, and passes the 404 on unchanged when the pool has ready nodes (a model none serves)."""
    down, up = (BackgroundServer(router_without_workers(ready), ready_path="/health").start() for ready in (0, 1))
    try:
        async def go(router: str) -> list[httpx.Response]:
            front = Front(FrontConfig(pools={"realtime": router}, default_pool="realtime", session_idle_s=90))
            port = free_port("127.0.0.1")
            listener = await front.serve("127.0.0.1", port)
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as c:
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                    out = [await c.post("/v1/chat/completions", json=body),  # two over one kept-alive connection
                           await c.post("/v1/chat/completions", json={**body, "stream": True})]
                    out.append(await c.get("/fleet/metrics"))
                    return out
            finally:
                listener.close()
                await front.aclose()

        outage, streamed, metrics = run(go(down.url))
        unknown, _, _ = run(go(up.url))
    finally:
        down.stop()
        up.stop()
    for r in (outage, streamed):
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "no_ready_node" and err["type"] == "server_error"
        assert "no node of pool 'realtime' is ready" in err["message"] and "fleet status" in err["message"]
    assert outage.headers["set-cookie"].startswith("lineside_session=")  # the front's own headers still go on
    assert 'lineside_fleet_requests_total{pool="realtime",status="5xx"} 2.0' in metrics.text
    assert unknown.status_code == 404 and unknown.content == SMG_NO_WORKER


@pytest.mark.parametrize(("share", "n", "expected"), [(0.5, 10, 5), (0.05, 100, 5), (1.0, 3, 3), (0.3, 10, 3)])
def test_share_sampler_is_deterministic(share, n, expected):
    s = ShareSampler(share)
    assert sum(s() for _ in range(n)) == expected


def test_answer_text_of_both_shapes():
    assert answer_text(b'{"choices": [{"message": {"content": "a"}}, {"text": "b"}]}') == "ab"
    assert answer_text(b"not json") == ""
    sse = [b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\ndata: {"choices": [{"delta": ',
           b'{"content": "x"}}]}\n\ndata: [DONE]\n\n']
    assert sse_text(sse) == "x"
