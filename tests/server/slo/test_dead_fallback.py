"""A fallback that failed for good (its backend broke: engine_health.py) takes no more of the guard's requests:
they go to the primary, which still serves, and /health's slo block says the fallback failed."""

from __future__ import annotations

import shutil

import httpx
import pytest

from lineside.runtime.engine import LLMEngine
from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import SloPolicy
from tests.runtime.fakes import FakeBackend
from tests.server.conftest import make_engine, running_server

BROKEN = "CUDA error: an illegal memory access was encountered"


def _complete(url: str, prompt: str = "hello there") -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                      timeout=60)


@pytest.fixture
def broken_fallback(tiny_bundle, tmp_path):
    fallback_dir = tmp_path / "tiny-fallback"
    shutil.copytree(tiny_bundle, fallback_dir)
    backend = FakeBackend(2, max_seq_len=128, vocab_size=300)
    fallback = LLMEngine(fallback_dir, backend=backend, num_slots=2, max_failed_steps=1)
    guard = SloGuard(SloPolicy(window_s=30), fallback=fallback, fallback_name="tiny-fallback",
                     device=lambda: (None, None), ticking=False)
    with running_server(make_engine(tiny_bundle, num_slots=2), slo_guard=guard) as srv:
        for _ in range(5):
            guard.signals.observe(ttft_s=2.0, queue_s=0.0)
        assert int(guard.tick(device=(None, None))) == 2
        srv.guard, srv.backend, srv.fallback = guard, backend, fallback
        yield srv


def test_requests_go_to_the_primary_once_the_fallback_failed(broken_fallback):
    srv = broken_fallback
    assert _complete(srv.url).json()["model"] == "tiny-fallback"
    srv.backend.broken = RuntimeError(BROKEN)
    failed = _complete(srv.url, "fails on the fallback")  # its step fails, then the probe: the fallback failed
    assert failed.status_code == 500 and srv.fallback.failure is not None
    after = [_complete(srv.url, f"after {i}") for i in range(3)]
    assert [r.status_code for r in after] == [200] * 3
    assert {r.json()["model"] for r in after} == {"tiny-llama"}
    assert {r.headers["x-lineside-degraded"] for r in after} == {"2"}
    slo = httpx.get(srv.url + "/health").json()["slo"]
    assert slo["level"] == 2 and BROKEN in slo["fallback_failure"]
