"""/metrics while the guard sends work to the fallback: requests running there are requests running (the gauges
are not only the primary's), and a level-2 cache answer is no request the fallback served."""

from __future__ import annotations

import shutil

import httpx
import pytest

from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import SloPolicy
from tests.server.conftest import make_engine, metric, running_server


@pytest.fixture(scope="module")
def degraded(tiny_bundle, tmp_path_factory):
    """A server at level 2 (every new request to the fallback), its fallback slowed so a request stays running."""
    fallback_dir = tmp_path_factory.mktemp("fb") / "tiny-fallback"
    shutil.copytree(tiny_bundle, fallback_dir)
    primary = make_engine(tiny_bundle, num_slots=2)
    fallback = make_engine(fallback_dir, num_slots=2, delay=0.02)
    guard = SloGuard(SloPolicy(window_s=30), fallback=fallback, fallback_name="tiny-fallback",
                     device=lambda: (None, None), ticking=False)
    with running_server(primary, slo_guard=guard) as srv:
        for _ in range(5):
            guard.signals.observe(ttft_s=2.0, queue_s=0.0)
        assert int(guard.tick(device=(None, None))) == 2
        yield srv


def _scrape(srv) -> str:
    return httpx.get(srv.url + "/metrics").text


def test_a_request_running_on_the_fallback_is_in_the_running_gauge(degraded):
    body = {"prompt": "keep going", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", degraded.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["x-lineside-degraded"] == "2"
        lines = r.iter_lines()  # held: a generator dropped mid-stream closes the response (the client leaves)
        next(line for line in lines if line.startswith("data: {"))  # a token came: it holds a fallback slot
        text = _scrape(degraded)
    assert metric(text, "lineside_num_requests_running") == 1
    assert metric(text, "lineside_num_requests_waiting") == 0


def test_a_cache_answer_is_not_counted_as_a_fallback_request(degraded):
    body = {"prompt": "answer me again", "max_tokens": 3, "temperature": 0}
    first = httpx.post(degraded.url + "/v1/completions", json=body, timeout=60)
    assert first.status_code == 200 and first.json()["model"] == "tiny-fallback"
    before = _scrape(degraded)
    again = httpx.post(degraded.url + "/v1/completions", json=body, timeout=60)
    assert again.headers.get("x-lineside-cache") == "hit"
    after = _scrape(degraded)
    assert metric(after, "lineside_slo_cache_lookups_total", 'result="hit"') \
        - metric(before, "lineside_slo_cache_lookups_total", 'result="hit"') == 1
    assert metric(after, "lineside_slo_fallback_requests_total") \
        == metric(before, "lineside_slo_fallback_requests_total")  # no model ran for it
