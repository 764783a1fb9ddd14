"""Level 1's batch gate under overload in a running server: requests held there are waiting ones, so past the
primary's --max-waiting (held and queued together) a batch request gets the queue-full 429 with Retry-After (not
an unbounded hold), /metrics counts the held ones as waiting, and a client that leaves while held is let go at
once (counted cancelled, no engine request made). The engine is held at a forward (a fake backend's pause) and
the gate's progress is read from its own polls of the engine: nothing sleeps to sync."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import SloPolicy
from tests.runtime.fakes import FakeBackend
from tests.server.conftest import CountingEngine, metric, running_server


class WatchedEngine(CountingEngine):
    """Tells the test when ``expect`` requests were submitted, and when the gate, polling stats(), has seen a held
    count that ``held_ok`` accepts."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.guard: SloGuard | None = None
        self.held_ok, self.held_seen = (lambda n: False), threading.Event()

    def stats(self):
        if self.guard is not None and self.held_ok(self.guard.held):
            self.held_seen.set()
        return super().stats()

    def until_held(self, ok) -> None:
        self.held_seen.clear()
        self.held_ok = ok
        assert self.held_seen.wait(30), f"the gate never held a count accepted (held {self.guard.held})"


def _raw_batch(port: int) -> socket.socket:
    """A batch request on a socket of its own, to close while it is held."""
    body = json.dumps({"prompt": "held then gone", "max_tokens": 2, "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"X-Mode: batch\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def _complete(url: str, prompt: str, mode: str = "realtime") -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers={"X-Mode": mode}, timeout=60,
                      json={"prompt": prompt, "max_tokens": 2, "temperature": 0})


def test_held_batch_requests_are_bounded_counted_and_let_go(tiny_bundle):
    be = FakeBackend(1, max_seq_len=128, vocab_size=300)
    engine = WatchedEngine(tiny_bundle, backend=be, num_slots=1, max_waiting=3)
    guard = SloGuard(SloPolicy(fallback_modes=(), fallback_priorities=(), min_samples=1), clock=lambda: 1000.0,
                     device=lambda: (None, None), ticking=False)
    engine.guard = guard
    with running_server(engine, slo_guard=guard) as srv, ThreadPoolExecutor(4) as pool:
        port = int(srv.url.rsplit(":", 1)[1])
        guard.signals.observe(ttft_s=1.0, queue_s=0.0)
        assert guard.tick(device=(None, None)) == 1
        be.pause(lambda batch: True)  # the engine stands at its next forward until resumed
        engine.expect = 2
        running = pool.submit(_complete, srv.url, "running")
        queued = pool.submit(_complete, srv.url, "queued")
        assert engine.all_in.wait(30)  # one runs (held at its forward), one waits: the gate holds batch work
        gone = _raw_batch(port)
        kept = pool.submit(_complete, srv.url, "held batch", "batch")
        engine.until_held(lambda n: n == 2)

        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        with pytest.raises(openai.RateLimitError) as refused:  # 2 held + 1 queued = --max-waiting 3
            client.completions.create(model="tiny-llama", prompt="one too many", max_tokens=2,
                                      extra_headers={"X-Mode": "batch"})
        assert refused.value.status_code == 429 and refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "queue_full"
        scrape = httpx.get(srv.url + "/metrics").text
        assert metric(scrape, "lineside_num_requests_waiting") == 3  # the queued one and the two held
        assert metric(scrape, "lineside_requests_total", 'outcome="queue_full"') == 1

        gone.close()  # its client leaves while held: let go now, not when the gate would open
        engine.until_held(lambda n: n == 1)
        scrape = httpx.get(srv.url + "/metrics").text
        assert metric(scrape, "lineside_requests_total", 'outcome="cancelled"') == 1
        assert metric(scrape, "lineside_num_requests_waiting") == 2
        assert engine.submitted == 2  # no engine request was made for it

        be.resume()
        assert [f.result().status_code for f in (running, queued, kept)] == [200, 200, 200]
        stats = engine.stats()
        assert (stats.running, stats.waiting, guard.held, engine.submitted) == (0, 0, 0, 3)
        assert all(owner is None for owner in engine.arena.owner) and engine.arena.used_blocks == 0
