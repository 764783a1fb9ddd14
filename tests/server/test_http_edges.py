"""HTTP-level edges real deployments hit, over loopback against the shared tiny server: bodies every JSON route
must answer the same way (malformed, empty, nested too deep), request bodies in a content coding, and the other
things a client or proxy sends that the routes' own tests do not."""

from __future__ import annotations

import httpx
import pytest

JSON = {"Content-Type": "application/json"}


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "code", "param"} and e["code"] == code, e
    assert e["message"] and "\n" not in e["message"]
    return e


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/prefill"])
@pytest.mark.parametrize("body, code, words", [
    (b"", "missing_field", "empty"),
    (b"{", "invalid_json", "not valid JSON"),
    (b'{"prompt": "x"} trailing', "invalid_json", "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json", "nested too deeply"),
])
def test_a_body_that_is_not_json_is_the_same_400_on_every_route(server, path, body, code, words):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        e = _error(c.post(path, content=body, headers=JSON), 400, code)
    assert words in e["message"], e
