"""What a server that runs for weeks keeps between requests stays within its bounds however many requests come:
each test drives many real requests through the app and counts what its store holds (no timing)."""

from __future__ import annotations

import inspect

import httpx
import pytest

from lineside.server.response_store import DEFAULT_STORED_RESPONSES_MB, ResponseStore, StoredResponse
from tests.server.conftest import running_server


def _respond(url: str, i: int, **extra) -> dict:
    body = {"input": f"tell me about part {i}", "max_output_tokens": 40, "top_logprobs": 20, "temperature": 1.0,
            "seed": i, **extra}
    r = httpx.post(url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_stored_responses_stay_within_their_bytes(tiny_bundle):
    """A count alone let long answers with top_logprobs (~1.3 KB of JSON a token) take gigabytes at the default 256;
    --max-stored-responses-mb bounds their bytes too, least recently used dropped first."""
    with running_server(tiny_bundle, num_slots=2, threads=1, max_stored_responses=1000,
                        max_stored_responses_mb=1) as srv:
        store = srv.state.responses
        ids = []
        for i in range(30):
            ids.append(_respond(srv.url, i)["id"])
            assert store.bytes <= 1 << 20 and len(store) <= i + 1
        assert store.bytes == sum(s.size for s in store._by_id.values())
        assert 1 < len(store) < 30  # some dropped: 30 answers of 40 tokens x 20 alternatives are over 1 MiB
        kept = httpx.get(f"{srv.url}/v1/responses/{ids[-1]}")
        assert kept.status_code == 200 and kept.json()["id"] == ids[-1]
        assert len(kept.json()["output"][0]["content"][0]["logprobs"]) > 0
        assert httpx.get(f"{srv.url}/v1/responses/{ids[0]}").status_code == 404
        # the newest goes on (the tiny model's byte tokenizer renders its 40 tokens longer: a short answer fits)
        _respond(srv.url, 99, previous_response_id=ids[-1], max_output_tokens=4)


def test_store_accounting_on_replace_and_delete():
    store = ResponseStore(10, max_bytes=1000)
    store.put("a", StoredResponse({"id": "a", "status": "completed", "x": "y" * 300}, ()))
    first = store.bytes
    store.put("a", StoredResponse({"id": "a", "status": "completed", "x": "y" * 300}, ()))
    assert store.bytes == first and len(store) == 1
    store.put("b", StoredResponse({"id": "b", "status": "completed", "x": "z" * 300}, ()))
    store.put("c", StoredResponse({"id": "c", "status": "completed", "x": "w" * 300}, ()))
    assert store.get("a") is None and store.bytes <= 1000  # a dropped: three are over 1000 bytes
    assert store.delete("b") and store.bytes == store.get("c").size
    big = StoredResponse({"id": "d", "status": "failed", "x": "q" * 5000}, ())
    store.put("d", big)  # larger than the whole budget: kept alone, so its answer can be continued
    assert list(store._by_id) == ["d"] and store.bytes == big.size and store.get("d").status == "failed"
    with pytest.raises(ValueError):
        ResponseStore(1, max_bytes=0)


def test_serve_default_is_the_stores():
    from lineside.server.app import create_app
    from lineside.server.commands import serve
    from lineside.server.state import ServerState

    for fn in (serve, create_app, ServerState.__init__):
        assert inspect.signature(fn).parameters["max_stored_responses_mb"].default == DEFAULT_STORED_RESPONSES_MB
