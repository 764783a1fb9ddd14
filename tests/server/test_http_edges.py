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


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "GZIP", "gzip, identity"])
def test_a_compressed_body_is_a_415_naming_the_coding(server, coding):
    """No OpenAI-compatible server inflates request bodies (vLLM, llama.cpp and Ollama read the bytes as JSON); the
    answer must say why rather than call the gzip header's bytes UTF-16 or malformed JSON (RFC 9110 15.5.16)."""
    import gzip

    body = gzip.compress(b'{"prompt": "x", "max_tokens": 1}')
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", content=body, headers={**JSON, "Content-Encoding": coding})
        e = _error(r, 415, "unsupported_content_encoding")
        assert coding.lower().split(",")[0] in e["message"] and "uncompressed" in e["message"], e
        assert r.headers["accept-encoding"] == "identity"
        # identity is no coding at all
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Content-Encoding": "identity"})
        assert r.status_code == 200, r.text
