"""A request's n choices are admitted together or not at all: one that meets a full waiting queue partway used to
cancel the choices already in, but those held their queue places until the next step, so the next request got a
429 it should not. The engine is held at a forward (a fake backend's pause): nothing sleeps to sync."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lineside.runtime.engine import LLMEngine
from lineside.runtime.request import GenerationRequest, QueueFullError
from tests.runtime.fakes import FakeBackend
from tests.server.conftest import CountingEngine, metric, running_server


def _complete(url: str, prompt: str, n: int = 1) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "n": n})


def test_a_refused_n_request_holds_no_queue_place(tiny_bundle):
    be = FakeBackend(1, max_seq_len=128, vocab_size=300)
    engine = CountingEngine(tiny_bundle, backend=be, num_slots=1, max_waiting=2)
    with running_server(engine) as srv, ThreadPoolExecutor(3) as pool:
        be.pause(lambda batch: True)  # the engine stands at its next forward until resumed
        engine.expect = 2
        running = pool.submit(_complete, srv.url, "running")
        queued = pool.submit(_complete, srv.url, "queued")
        assert engine.all_in.wait(30)
        assert be.paused.wait(30)  # one runs (held at its forward), one waits: one waiting place is left
        too_many = _complete(srv.url, "two choices", n=2)  # 1 + 2 > --max-waiting 2: refused whole
        assert too_many.status_code == 429, too_many.text
        assert too_many.json()["error"]["code"] == "queue_full"
        engine.expect = 3
        engine.all_in.clear()
        one_more = pool.submit(_complete, srv.url, "fits")  # the last place is free: the refused n=2 took none
        try:
            assert engine.all_in.wait(30), one_more.result(30).text
            assert engine.stats().waiting == 2
        finally:
            be.resume()
        for f in (running, queued, one_more):
            assert f.result(60).status_code == 200, f.result().text
        scrape = httpx.get(srv.url + "/metrics").text
        assert metric(scrape, "lineside_requests_total", 'outcome="queue_full"') == 1


def test_submit_all_takes_every_request_or_none(tiny_bundle):
    be = FakeBackend(1, max_seq_len=128, vocab_size=300)
    engine = LLMEngine(tiny_bundle, backend=be, num_slots=1, max_waiting=2)
    try:
        engine.submit(GenerationRequest(prompt_ids=[1, 5], max_tokens=2, request_id="a"))
        reqs = [GenerationRequest(prompt_ids=[1, 5], max_tokens=2, request_id=f"b{i}") for i in range(3)]
        with pytest.raises(QueueFullError):  # the free slot takes one; 3 - 1 + 1 > 2 wait
            engine.submit_all(reqs)
        assert [s.req.request_id for s in engine._incoming] == ["a"]
        engine.submit_all(reqs[:2])  # 3 in, 1 slot: 2 wait, the bound
        assert len(engine._incoming) == 3
        with pytest.raises(QueueFullError):
            engine.submit(GenerationRequest(prompt_ids=[1, 5], max_tokens=2, request_id="c"))
    finally:
        engine.close()
