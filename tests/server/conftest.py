"""Server fixtures: in-process servers on 127.0.0.1 (free port) over the root conftest's tiny_bundle, a slowed
backend."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from lineside.bench.inprocess import BackgroundServer
from lineside.runtime.engine import LLMEngine


class SlowBackend:
    """Wraps a backend and sleeps before each step: makes running / waiting states last long enough
    to observe (cancellation, queue full, timeouts, drain) without a big model."""

    def __init__(self, inner, delay: float):
        self.inner = inner
        self.delay = delay
        for name in ("name", "flavor", "num_slots", "max_seq_len", "vocab_size"):
            setattr(self, name, getattr(inner, name))

    def forward(self, batch):
        time.sleep(self.delay)
        return self.inner.forward(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make_engine(bundle: Path, *, num_slots: int = 4, max_waiting: int = 256, delay: float = 0.0, **kw):
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(bundle)
    be = OnnxRuntimeBackend(b, num_slots=num_slots, threads=1)
    if delay:
        be = SlowBackend(be, delay)
    return LLMEngine(b, backend=be, num_slots=num_slots, max_waiting=max_waiting, **kw)


@contextmanager
def running_server(source, limits=None, **app_kw):
    """create_app(source, **app_kw) on 127.0.0.1:<free port> under the protocol and HTTP limits `lineside serve`
    uses (``limits``: an HttpLimits, default the server's), ready when yielded."""
    from lineside.server.app import create_app
    from lineside.server.http_limits import HttpLimits, uvicorn_config

    app = create_app(source, **app_kw)

    def make_config(app, host, port):
        return uvicorn_config(app, host=host, port=port, limits=limits or HttpLimits(), log_level="warning")

    with BackgroundServer(app, startup_timeout=60, make_config=make_config) as srv:
        srv.app = app
        srv.state = app.state.lineside
        yield srv


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    """One shared server for the client tests (4 slots, latency log on; the log is the module's own: the bundle's
    directory is shared by every module, and under xdist by every worker)."""
    log = tmp_path_factory.mktemp("latency") / "latency.jsonl"
    with running_server(tiny_bundle, num_slots=4, threads=1, latency_log=log) as srv:
        srv.latency_log = log
        yield srv


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from a Prometheus text exposition (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def openai_client(server):
    """The real openai client on the shared ``server`` (no retries: a test sees the first answer)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref_logprobs(tiny_dense):
    """ids -> log_softmax of transformers' float32 logits of the tiny bundle's checkpoint (row p scores token p + 1):
    the reference prompt scores (echo, prompt_logprobs) are checked against."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dense("llama-gqa"), dtype=torch.float32).eval()

    def get(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()

    return get


def tokenize(server, text: str) -> list[int]:
    """The server's own ids for ``text`` (/tokenize)."""
    import httpx

    r = httpx.post(server.url + "/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


class CountingEngine(LLMEngine):
    """Sets ``all_in`` once ``expect`` requests were submitted: the test acts when every one is in the engine."""

    expect = 0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.submitted, self.all_in = 0, threading.Event()

    def submit_all(self, reqs):
        handles = super().submit_all(reqs)  # submit() goes through here too
        self.submitted += len(handles)
        if self.submitted >= self.expect:
            self.all_in.set()
        return handles
