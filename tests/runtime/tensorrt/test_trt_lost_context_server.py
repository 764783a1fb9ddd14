"""A lost CUDA context under the server, on the strict TensorRT fake: the engine fails at the first step (not after
--max-failed-steps), /health answers 503 naming the CUDA error, and `serve`'s run() ends with that one line (the
CLI's exit 1). Nothing sleeps to sync."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import httpx
import pytest

from lineside.bench.inprocess import wait_ready
from lineside.errors import LinesideError
from lineside.runtime.engine import LLMEngine
from tests.runtime.tensorrt.bundles import fake_engine_bundle
from tests.runtime.tensorrt.fake_trt import Fault
from tests.server.conftest import metric, running_server


@pytest.fixture
def trt_engine(trt_bundle, monkeypatch, tmp_path):
    """An LLMEngine on the TensorRT backend (2 slots) over the fake, and the fake's device."""
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = fake_engine_bundle(trt_bundle, monkeypatch, tmp_path, num_slots=2)
    return LLMEngine(b, backend=TensorRTBackend(b, num_slots=2), num_slots=2, max_failed_steps=3), dev


def complete(url: str, prompt, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, **kw},
                      timeout=60)


def test_lost_context_fails_the_engine_at_once_and_health_turns_503(trt_engine):
    eng, dev = trt_engine
    with running_server(eng) as srv:
        assert complete(srv.url, [1, 5, 6]).status_code == 200
        dev.inject(Fault.ILLEGAL_ADDRESS)
        lost = complete(srv.url, [1, 5, 7])
        alive, ready = httpx.get(srv.url + "/health"), httpx.get(srv.url + "/health/ready")
        after = complete(srv.url, [1, 5, 8])
        scrape = httpx.get(srv.url + "/metrics").text
    assert lost.status_code == 500 and "cudaErrorIllegalAddress" in lost.json()["error"]["message"]
    for r in (alive, ready):
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "failed" and body["error"]["code"] == "engine_failed"
        assert "CUDA context is lost (cudaErrorIllegalAddress in " in body["reason"] and "\n" not in body["reason"]
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_failed"
    # one failed step was enough: the error is sticky, so no probe and no waiting for --max-failed-steps
    assert metric(scrape, "lineside_engine_failed") == 1 and metric(scrape, "lineside_engine_failed_steps_total") == 1


def test_serve_exits_with_the_lost_context_line(trt_engine):
    from lineside.server.app import create_app
    from lineside.server.bind import bind_socket
    from lineside.server.serve import run

    eng, dev = trt_engine
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    ended: Future[None] = Future()

    def serve() -> None:
        try:
            run(create_app(eng), sock, log_level="warning")
            ended.set_result(None)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            ended.set_exception(e)

    threading.Thread(target=serve, daemon=True).start()
    wait_ready(url, 60, alive=lambda: not ended.done())
    dev.inject(Fault.ECC_UNCORRECTABLE)
    assert complete(url, [1, 5, 6]).status_code == 500
    with pytest.raises(LinesideError) as exited:
        ended.result(timeout=60)
    message = str(exited.value)
    assert "\n" not in message and message.startswith("the model engine failed: ")
    assert "CUDA context is lost (cudaErrorECCUncorrectable in " in message
