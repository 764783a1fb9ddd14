"""vLLM's cache_salt: requests with different salts never reuse each other's cached prompt prefix (usage's
cached_tokens and the prefix-cache metrics say so), nor a prefill session's KV; the same salt (or none) shares as
before, and the answer is the same whatever the salt. A salt that is not a non-empty string is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import metric, running_server

SYSTEM = "the line stops at station twelve when the oven runs hot and the technician logs it " * 2
GREEDY = {"max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def srv(tiny_bundle):
    with running_server(tiny_bundle, num_slots=4, threads=1, max_sessions=2) as s:
        yield s


def chat(srv, probe: str, **extra) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": probe}], **GREEDY, **extra}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    usage = answer["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return details["cached_tokens"]


def hits(srv) -> float:
    return metric(httpx.get(srv.url + "/metrics").text, "lineside_prefix_cache_hit_requests_total")


def test_different_salts_never_share_a_cached_prefix(srv):
    before = hits(srv)
    first = chat(srv, "why? (chat)", cache_salt="tenant-a")
    assert cached(first) == 0
    same = chat(srv, "why? (chat)", cache_salt="tenant-a")  # the same salt shares, as without one
    assert cached(same) >= first["usage"]["prompt_tokens"] // 2
    other = chat(srv, "why? (chat)", cache_salt="tenant-b")
    unsalted = chat(srv, "why? (chat)")
    assert cached(other) == 0 and cached(unsalted) == 0  # neither reads tenant-a's KV
    again = chat(srv, "why? (chat)")  # no salt: the shared pool, as before
    assert cached(again) >= first["usage"]["prompt_tokens"] // 2
    assert chat(srv, "why? (chat)", cache_salt="tenant-b")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert hits(srv) - before == 3  # tenant-a's repeat, the unsalted repeat, tenant-b's repeat
    texts = {a["choices"][0]["message"]["content"] for a in (first, same, other, unsalted, again)}
    assert len(texts) == 1  # the salt changes who shares KV, never the answer


def test_completions_and_responses_take_the_salt(srv):
    prompt = SYSTEM + "so the completion says"
    ask = lambda **kw: httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, **GREEDY, **kw},  # noqa: E731
                                  timeout=60).json()
    assert cached(ask(cache_salt="c-1")) == 0
    assert cached(ask(cache_salt="c-1")) > 0
    assert cached(ask(cache_salt="c-2")) == 0

    def respond(**kw) -> dict:
        r = httpx.post(srv.url + "/v1/responses", json={"input": SYSTEM + "respond", "max_output_tokens": 4,
                                                          "temperature": 0, "store": False, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    assert cached(respond(cache_salt="r-1")) == 0
    assert cached(respond(cache_salt="r-1")) > 0
    assert cached(respond(cache_salt="r-2")) == 0


def settle(c: httpx.Client, sid: str) -> None:
    for _ in range(2000):  # bounded: the tiny model computes a chunk in milliseconds
        if c.get(f"/v1/prefill/{sid}").json()["pending_tokens"] == 0:
            return
    raise AssertionError("session never settled")


def test_a_prefill_session_is_lent_only_within_its_salt(srv):
    prompt = SYSTEM + "the session's prompt"
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for sid, salt in (("salted-1", "s-1"), ("salted-2", "s-1")):
            assert c.post("/v1/prefill", json={"prompt": prompt, "session_id": sid,
                                               "cache_salt": salt}).status_code == 202
            settle(c, sid)
        # another salt naming the session, or none: nothing of it is lent, nor found by prefix
        foreign = c.post("/v1/completions", json={"prompt": prompt, "session_id": "salted-1", "cache_salt": "s-2",
                                                  **GREEDY}).json()
        plain = c.post("/v1/completions", json={"prompt": prompt, **GREEDY}).json()
        assert cached(foreign) == 0 and cached(plain) == 0
        own = c.post("/v1/completions", json={"prompt": prompt, "session_id": "salted-2", "cache_salt": "s-1",
                                              **GREEDY}).json()
        assert cached(own) > 0
        assert own["choices"][0]["text"] == foreign["choices"][0]["text"] == plain["choices"][0]["text"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/prefill"])
@pytest.mark.parametrize("salt", [5, "", True, ["a"], {"a": 1}])
def test_a_salt_not_a_non_empty_string_is_a_400_naming_it(srv, route, salt):
    body = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
            "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"},
            "/v1/prefill": {"prompt": "hi", "session_id": "bad-salt"}}[route]
    r = httpx.post(srv.url + route, json={**body, "max_tokens": 1, "cache_salt": salt}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt", r.text


def test_a_null_salt_is_no_salt(srv):
    assert chat(srv, "null salt", cache_salt=None)["choices"][0]["message"]["content"] is not None
