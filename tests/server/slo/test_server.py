"""The guard in a running server: levels driven by TTFT samples on a fake clock; the fallback and the cache
answer; headers, `model`, /health, /metrics and the latency log say so; no request is lost across a switch."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lineside.server.slo import SloView
from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import SloPolicy
from tests.server.conftest import make_engine, metric, running_server


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _push(guard: SloGuard, ttft: float, count: int = 5) -> int:
    """Samples as slow (or fast) requests would leave them, then one controller step."""
    for _ in range(count):
        guard.signals.observe(ttft_s=ttft, queue_s=0.0)
    return int(guard.tick(device=(None, None)))


def _chat(url: str, text: str = "hi", *, mode: str | None = None, **extra) -> httpx.Response:
    headers = {"X-Mode": mode} if mode else {}
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, headers=headers,
                      json={"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0,
                            **extra})


@pytest.fixture(scope="module")
def guarded(tiny_bundle, tmp_path_factory):
    fallback_dir = tmp_path_factory.mktemp("fb") / "tiny-fallback"
    shutil.copytree(tiny_bundle, fallback_dir)
    log = tmp_path_factory.mktemp("log") / "latency.jsonl"
    clock = FakeClock()
    primary = make_engine(tiny_bundle, num_slots=4, delay=0.03)
    fallback = make_engine(fallback_dir, num_slots=4)
    policy = SloPolicy(window_s=30, recover_after_s=300)
    guard = SloGuard(policy, fallback=fallback, fallback_name="tiny-fallback", clock=clock,
                     device=lambda: (None, None), ticking=False)
    with running_server(primary, latency_log=log, slo_guard=guard) as srv:
        srv.guard, srv.clock, srv.primary, srv.fallback, srv.log = guard, clock, primary, fallback, log
        yield srv


def _taken(engine) -> int:
    stats = engine.stats()
    return stats.running + stats.waiting


def _finished(engine) -> int:
    return sum(engine.stats().requests.values())


def test_levels_headers_model_health_metrics_and_log(guarded):
    srv, guard = guarded, guarded.guard
    r = _chat(srv.url)
    assert r.status_code == 200 and r.json()["model"] == "tiny-llama" and "x-lineside-degraded" not in r.headers
    assert SloView(srv.url).read().level == 0

    assert _push(guard, 1.0) == 1
    health = httpx.get(f"{srv.url}/health").json()["slo"]
    assert (health["level"], health["reason"], health["fallback"]) == (1, "ttft_p90_s", "tiny-fallback")
    assert health["ttft_p90_s"] == pytest.approx(1.0)
    realtime = _chat(srv.url, "realtime")
    assert realtime.headers["x-lineside-degraded"] == "1" and realtime.json()["model"] == "tiny-llama"
    batch = _chat(srv.url, "batch job", mode="batch")  # the policy names batch traffic for the fallback
    assert batch.status_code == 200 and batch.json()["model"] == "tiny-fallback"

    assert _push(guard, 2.0) == 2
    first = _chat(srv.url, "repeat me")
    assert first.json()["model"] == "tiny-fallback" and first.headers["x-lineside-degraded"] == "2"
    again = _chat(srv.url, "repeat me")
    assert again.headers.get("x-lineside-cache") == "hit"
    assert again.json()["choices"] == first.json()["choices"] and again.json()["id"] != first.json()["id"]
    hot = _chat(srv.url, "repeat me", temperature=0.9)  # not reproducible: never from the cache
    assert "x-lineside-cache" not in hot.headers and hot.status_code == 200
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "repeat me"}], "max_tokens": 4,
                            "temperature": 0, "stream": True}) as stream:  # streamed: the fallback, not the cache
        assert stream.headers["x-lineside-degraded"] == "2" and "x-lineside-cache" not in stream.headers
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks and {chunk["model"] for chunk in chunks} == {"tiny-fallback"}
    assert "x-lineside-cache" not in hot.headers and hot.status_code == 200

    text = httpx.get(f"{srv.url}/metrics").text
    assert metric(text, "lineside_slo_degradation_level") == 2
    assert metric(text, "lineside_slo_transitions_total", 'level="2",reason="ttft_p90_s"') == 1
    assert metric(text, "lineside_slo_fallback_requests_total") >= 3
    assert metric(text, "lineside_slo_cache_lookups_total", 'result="hit"') == 1
    # the cache's answer is a request too (it was not counted, nor logged): outcome cached, its level in the log
    assert metric(text, "lineside_requests_total", 'outcome="cached"') == 1
    generated = sum(json.loads(row)["completion_tokens"] for row in srv.log.read_text().splitlines()
                    if json.loads(row)["outcome"] != "cached")
    assert metric(text, "lineside_generation_tokens_total") == generated  # the cache generated nothing
    cached = [row for row in map(json.loads, srv.log.read_text().splitlines()) if row["outcome"] == "cached"]
    assert len(cached) == 1 and cached[0]["slo_level"] == 2 and cached[0]["bundle"] == "tiny-fallback"
    assert cached[0]["completion_tokens"] == again.json()["usage"]["completion_tokens"]

    # recovery: one level per recover_after, measured on the fake clock
    srv.clock.now += 40  # the slow samples leave the 30 s window
    assert _push(guard, 0.01) == 2
    srv.clock.now += 299
    assert _push(guard, 0.01) == 2
    srv.clock.now += 2
    assert _push(guard, 0.01) == 1
    srv.clock.now += 301
    assert _push(guard, 0.01) == 0
    normal = _chat(srv.url, "repeat me")
    assert "x-lineside-degraded" not in normal.headers and "x-lineside-cache" not in normal.headers  # level 0: no cache
    assert normal.json()["model"] == "tiny-llama"
    rows = [json.loads(line) for line in srv.log.read_text().splitlines()]
    assert {row["slo_level"] for row in rows} >= {0, 1, 2}
    assert {row["bundle"] for row in rows} == {"tiny-llama", "tiny-fallback"}


def test_no_request_is_lost_or_moved_across_switches(guarded):
    srv, guard = guarded, guarded.guard
    assert _push(guard, 0.01) == 0
    before = (_finished(srv.primary), _finished(srv.fallback))
    with ThreadPoolExecutor(12) as pool:
        early = [pool.submit(_chat, srv.url, f"early {i}", max_tokens=12) for i in range(6)]
        deadline = time.monotonic() + 60
        while _taken(srv.primary) < 6 and time.monotonic() < deadline:  # all six taken by the primary
            time.sleep(0.005)
        assert _push(guard, 5.0) == 2  # switch while the early ones run on the primary
        late = [pool.submit(_chat, srv.url, f"late {i}") for i in range(6)]
        early_r = [f.result() for f in early]
        late_r = [f.result() for f in late]
    assert [r.status_code for r in early_r + late_r] == [200] * 12
    assert {r.json()["model"] for r in early_r} == {"tiny-llama"}  # finished where they were taken
    assert {r.json()["model"] for r in late_r} == {"tiny-fallback"}
    assert (_finished(srv.primary) - before[0], _finished(srv.fallback) - before[1]) == (6, 6)
    for _ in range(3):  # calm from here: 2 → 1 → 0, one recover_after apart
        _push(guard, 0.01, count=0)
        srv.clock.now += 10_000
    assert _push(guard, 0.01, count=0) == 0


def test_level_1_holds_batch_behind_waiting_realtime_and_loses_nothing(tiny_bundle):
    clock = FakeClock()
    primary = make_engine(tiny_bundle, num_slots=1, delay=0.02)
    policy = SloPolicy(fallback_modes=(), fallback_priorities=(), batch_running_cap=1, min_samples=1)
    guard = SloGuard(policy, clock=clock, device=lambda: (None, None), ticking=False)
    with running_server(primary, slo_guard=guard) as srv:
        assert _push(guard, 1.0, count=1) == 1
        with ThreadPoolExecutor(8) as pool:
            realtime = [pool.submit(_chat, srv.url, f"rt {i}", max_tokens=8) for i in range(4)]
            deadline = time.monotonic() + 60
            while _taken(primary) < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            batch = [pool.submit(_chat, srv.url, f"batch {i}", mode="batch", max_tokens=4) for i in range(3)]
            results = [f.result() for f in realtime + batch]
        text = httpx.get(f"{srv.url}/metrics").text
    assert [r.status_code for r in results] == [200] * 7
    assert {r.headers["x-lineside-degraded"] for r in results} == {"1"}
    assert {r.json()["model"] for r in results} == {"tiny-llama"}  # no fallback: everything on the primary
    assert metric(text, "lineside_slo_batch_held_total") >= 1  # they waited at the gate while realtime queued
    assert metric(text, "lineside_slo_finished_requests_total", 'mode="batch",on_time="true"') == 3


def test_the_responses_route_is_guarded_as_the_completion_routes_are(guarded):
    """/v1/responses goes through the same ladder: at level 2 to the fallback, with the degraded header, streamed
    or not (it used to submit to the primary whatever the level, and said nothing)."""
    srv, guard = guarded, guarded.guard
    assert _push(guard, 2.0) == 2
    try:
        before = _finished(srv.fallback)
        body = {"input": "degraded", "max_output_tokens": 4, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/responses", timeout=120, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny-fallback" and r.headers["x-lineside-degraded"] == "2"
        assert "x-lineside-cache" not in r.headers  # a Responses body is never a cached chat completion
        with httpx.stream("POST", f"{srv.url}/v1/responses", timeout=120, json={**body, "stream": True}) as stream:
            assert stream.headers["x-lineside-degraded"] == "2"
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        done = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
        assert len(done) == 1 and done[0]["response"]["model"] == "tiny-fallback"
        assert _finished(srv.fallback) - before == 2
    finally:
        for _ in range(3):
            _push(guard, 0.01, count=0)
            srv.clock.now += 10_000
        assert _push(guard, 0.01, count=0) == 0


def test_a_request_keeping_its_session_stays_on_the_primary_that_holds_it(guarded):
    """keep_session asks this server to keep the turn's KV for the next one, in the session /v1/prefill shows and
    ends; at level 2 it went to the fallback: the primary's session ended, a hidden one opened on the fallback
    (pinning its KV, seen by no /v1/prefill call) and the next turn at level 0 found none."""
    srv, guard = guarded, guarded.guard
    assert _push(guard, 2.0) == 2
    try:
        text = "the line stops at station 12"
        assert httpx.post(f"{srv.url}/v1/prefill", timeout=30,
                          json={"messages": [{"role": "user", "content": text}], "session_id": "kept"}).status_code == 202
        r = _chat(srv.url, text, keep_session=True, session_id="kept")
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny-llama" and r.headers["x-lineside-degraded"] == "2"
        assert httpx.get(f"{srv.url}/v1/prefill/kept", timeout=30).status_code == 200  # kept, as asked
        assert srv.fallback.session("kept") is None
        plain = _chat(srv.url, text, session_id="kept")  # no keep_session: the fallback may take it, the session ends
        assert plain.status_code == 200 and plain.json()["model"] == "tiny-fallback"
        assert httpx.get(f"{srv.url}/v1/prefill/kept", timeout=30).status_code == 404
    finally:
        for _ in range(3):
            _push(guard, 0.01, count=0)
            srv.clock.now += 10_000
        assert _push(guard, 0.01, count=0) == 0
