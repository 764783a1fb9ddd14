"""The real SMG gateway started while none of its nodes answers: a request is a 503 the client retries (not
SMG's 404 model_not_found, which reads as a wrong model name), and /fleet/health says no pool can serve."""

from __future__ import annotations

import sys

import httpx
import pytest
import yaml

from tests.fleet.conftest import MODEL_NAME, Proc, free_ports, need
from tests.fleet.test_gateway import _until

pytestmark = pytest.mark.slow


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_gateway_whose_nodes_never_came_up_answers_503(tmp_path):
    need("smg", "pip install smg: the gateway's router")
    base = free_ports(6)  # two nodes nobody serves, the front, one router and its metrics
    fleet = {"nodes": [{"name": "w1", "kind": "x86", "url": f"http://127.0.0.1:{base}"},
                       {"name": "w2", "kind": "x86", "url": f"http://127.0.0.1:{base + 1}"}],
             "pools": {"realtime": {"members": ["w1", "w2"]}},
             "gateway": {"port": base + 2, "smg_base_port": base + 3}}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    gw = Proc([sys.executable, "-m", "lineside", "fleet", "gateway", str(path), "-o", str(tmp_path / "gw")],
              f"http://127.0.0.1:{base + 2}/fleet/metrics", tmp_path / "gateway.log")
    try:
        gw.start(timeout=120)
        _until(lambda: _answers(f"http://127.0.0.1:{base + 3}/health"), 60, "the pool's router")
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with httpx.Client(base_url=f"http://127.0.0.1:{base + 2}", timeout=30, trust_env=False) as c:
            plain = c.post("/v1/chat/completions", json=body)
            streamed = c.post("/v1/chat/completions", json={**body, "stream": True})
            health = c.get("/fleet/health")
    finally:
        gw.stop()
    for r in (plain, streamed):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_ready_node" and r.json()["error"]["type"] == "server_error"
    assert health.status_code == 503 and health.json()["pools"] == {"realtime": False}
