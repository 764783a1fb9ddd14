"""Health when the engine breaks with nobody watching: one bad request leaves the node ready; a backend that
fails step after step makes /health/ready and /health answer 503 naming the cause, new and waiting requests a 503
(never a hang), /metrics shows it, and `serve`'s run() ends with a one-line error (the CLI's exit 1) so a
supervisor restarts the process. Failures are counted in steps on a fake backend; nothing sleeps to sync."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from lineside.bench.inprocess import wait_ready
from lineside.errors import LinesideError
from tests.runtime.fakes import FakeBackend
from tests.server.conftest import CountingEngine, metric, running_server

BROKEN = "CUDA error: an illegal memory access was encountered"



def fake_engine(bundle, slots=1, **kw) -> tuple[CountingEngine, FakeBackend]:
    be = FakeBackend(slots, max_seq_len=128, vocab_size=300)
    be.poison = 250  # a prompt holding token 250 makes its forward raise (one bad request)
    return CountingEngine(bundle, backend=be, num_slots=slots, **kw), be


def complete(url: str, prompt, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **kw},
                      timeout=60)


def test_one_bad_request_leaves_the_node_ready(tiny_bundle):
    eng, _ = fake_engine(tiny_bundle, max_failed_steps=1)  # at the strictest limit: the probe forward works
    with running_server(eng) as srv:
        bad = complete(srv.url, [1, 250, 3])
        ready, alive = httpx.get(srv.url + "/health/ready"), httpx.get(srv.url + "/health")
        good = complete(srv.url, [1, 5, 6])
        scrape = httpx.get(srv.url + "/metrics").text
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
    assert ready.status_code == 200 and alive.status_code == 200 and good.status_code == 200
    # the failed step is counted; the next one worked, so the count in a row is back to 0
    assert metric(scrape, "lineside_engine_failed") == 0
    assert metric(scrape, "lineside_engine_consecutive_failed_steps") == 0
    assert metric(scrape, "lineside_engine_failed_steps_total") == 1


def test_persistent_failure_makes_the_node_unready_and_refuses_requests(tiny_bundle):
    eng, be = fake_engine(tiny_bundle, max_failed_steps=3)
    with running_server(eng) as srv:
        assert httpx.get(srv.url + "/health/ready").status_code == 200
        be.broken = RuntimeError(BROKEN + "\nstack details")
        first = [complete(srv.url, [1, 5, 6 + i]) for i in range(2)]
        still = httpx.get(srv.url + "/health/ready")  # 2 failed steps in a row: below the limit
        last = complete(srv.url, [1, 5, 9])
        ready, alive = httpx.get(srv.url + "/health/ready"), httpx.get(srv.url + "/health")
        head = httpx.head(srv.url + "/health")
        new = complete(srv.url, [1, 5, 6])
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        scrape = httpx.get(srv.url + "/metrics").text
    assert [r.status_code for r in first] == [500, 500] and still.status_code == 200
    assert last.status_code == 500 and last.json()["error"]["message"] == (
        f"generation failed in the engine: model step failed: {BROKEN}")
    cause = (f"3 consecutive model steps failed, the last with: model step failed: {BROKEN}; a probe forward failed "
             f"too (model step failed: {BROKEN})")
    for r in (ready, alive):
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "failed" and body["reason"] == cause
        assert body["error"]["code"] == "engine_failed" and body["error"]["type"] == "service_unavailable"
        assert cause in body["error"]["message"]
    assert head.status_code == 503
    for r in (new, chat):
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "engine_failed" and cause in err["message"] and "\n" not in err["message"]
    assert metric(scrape, "lineside_engine_failed") == 1
    assert metric(scrape, "lineside_engine_consecutive_failed_steps") == 3
    assert metric(scrape, "lineside_requests_total", 'outcome="engine_failed"') == 2


def test_waiting_requests_get_a_503_not_a_hang(tiny_bundle):
    """One slot, five requests in the engine while its first step is held; the backend then fails every step:
    three requests fail with their step (500), the engine fails, and the two still waiting are answered 503."""
    eng, be = fake_engine(tiny_bundle, max_failed_steps=3, max_waiting=8)
    eng.expect = 5
    with running_server(eng) as srv:
        be.pause(lambda batch: True)
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(complete, srv.url, [1, 5, 6 + i]) for i in range(5)]
            assert eng.all_in.wait(60), "the requests never reached the engine"
            be.paused.wait(60)
            be.broken = RuntimeError(BROKEN)
            be.resume()
            answers = [f.result(timeout=60) for f in futures]
    codes = sorted(r.status_code for r in answers)
    assert codes == [500, 500, 500, 503, 503]
    refused = [r.json()["error"] for r in answers if r.status_code == 503]
    assert all(e["code"] == "engine_failed" and "retry on another instance" in e["message"] for e in refused)


def test_serve_exits_with_one_line_once_the_engine_failed(tiny_bundle):
    """`serve`'s run(): the server stops by itself and raises the cause (the CLI prints it and exits 1)."""
    from lineside.server.app import create_app
    from lineside.server.bind import bind_socket
    from lineside.server.serve import run

    eng, be = fake_engine(tiny_bundle, max_failed_steps=2)
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = create_app(eng)
    ended: Future[None] = Future()

    def serve() -> None:
        try:
            run(app, sock, log_level="warning")
            ended.set_result(None)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            ended.set_exception(e)

    threading.Thread(target=serve, daemon=True).start()
    wait_ready(url, 60, alive=lambda: not ended.done())
    be.broken = RuntimeError(BROKEN)
    codes = [complete(url, [1, 5, 6 + i]).status_code for i in range(2)]
    with pytest.raises(LinesideError) as exited:
        ended.result(timeout=60)
    assert codes == [500, 500]
    message = str(exited.value)
    assert "\n" not in message and message.startswith("the model engine failed: 2 consecutive model steps failed")
    assert "supervisor restarts" in message


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_an_engine_that_fails_as_a_request_arrives_is_a_503_engine_failed_not_draining(tiny_bundle, route):
    """The middleware refuses requests once the server knows the engine failed; one that arrives as it fails reaches
    submit, which raises EngineFailed — a subclass of the draining refusal, so it was answered 'server is shutting
    down' (code draining, Retry-After) for a server that was not."""
    from lineside.runtime.engine_health import EngineFailed

    class FailingAtSubmit(CountingEngine):
        def submit_all(self, reqs):  # submit() goes through here too
            raise EngineFailed("the model engine failed: CUDA error: an illegal memory access was encountered")

    be = FakeBackend(1, max_seq_len=128, vocab_size=300)
    body = {"/v1/completions": {"prompt": [1, 5], "max_tokens": 2},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "/v1/responses": {"input": "hi", "max_output_tokens": 2}}[route]
    with running_server(FailingAtSubmit(tiny_bundle, backend=be, num_slots=1)) as srv:
        r = httpx.post(srv.url + route, json={"model": "tiny-llama", **body}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "engine_failed", r.text
        assert "illegal memory access" in err["message"] and "shutting down" not in err["message"]
        scrape = httpx.get(srv.url + "/metrics").text
        assert metric(scrape, "lineside_requests_total", 'outcome="engine_failed"') == 1
        assert metric(scrape, "lineside_requests_total", 'outcome="draining"') == 0
