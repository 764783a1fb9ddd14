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


def _raw(server, data: bytes) -> tuple[bytes, dict]:
    """Send ``data`` on a fresh connection and read until the server closes: (status line, error object)."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(data)
        got = bytearray()
        while chunk := s.recv(65536):
            got.extend(chunk)
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)["error"]


@pytest.mark.parametrize("request_bytes, words", [
    (b"GET /v1/models/caf\xc3\xa9 HTTP/1.1\r\nHost: localhost\r\n\r\n", "percent-encode"),  # curl sends it raw
    (b"GET /v1/models/a b HTTP/1.1\r\nHost: localhost\r\n\r\n", "percent-encode"),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "HTTP/2"),  # curl --http2-prior-knowledge, an h2 upstream
    (b"BREW /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n", "method"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
     "framing"),
])
def test_a_malformed_request_is_told_what_was_wrong_with_it(server, request_bytes, words):
    """The refusal's advice fits what the parser found: a URL with a raw space or UTF-8 is not a framing problem."""
    status, e = _raw(server, request_bytes)
    assert status.startswith(b"HTTP/1.1 400") and e["code"] == "malformed_http", (status, e)
    assert words in e["message"], e
    if words != "framing":
        assert "chunk" not in e["message"], e


def test_root_path_serves_behind_a_proxy_that_keeps_the_prefix(tiny_bundle):
    """vLLM's --root-path: a proxy that forwards /llm/v1/... as it came (no prefix stripping) reaches the routes, and
    what the server decides by path (the key's exemptions, the body limit, refusing work while draining) sees the
    route's path, not the prefixed one; one that strips the prefix still reaches them too."""
    from tests.server.conftest import running_server

    with running_server(tiny_bundle, num_slots=1, threads=1, api_key="k", root_path="/llm",
                        max_body_bytes=4096) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        key = {"Authorization": "Bearer k"}
        assert c.get("/llm/health").status_code == 200  # a probe needs no key under the prefix either
        assert c.get("/llm/health/ready").status_code == 200
        _error(c.get("/llm/v1/models"), 401, "invalid_api_key")
        assert c.get("/llm/v1/models", headers=key).json()["data"]
        assert c.get("/v1/models", headers=key).status_code == 200  # a stripping proxy
        r = c.post("/llm/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=key)
        assert r.status_code == 200 and r.json()["choices"], r.text
        _error(c.post("/llm/v1/completions", json={"prompt": "x" * 5000}, headers=key), 413, "body_too_large")
        srv.state.draining = True
        try:
            _error(c.post("/llm/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=key), 503, "draining")
        finally:
            srv.state.draining = False


@pytest.mark.parametrize("value, words", [("llm", "begin with '/'"), ("/llm?x=1", "path"), ("/a b", "path")])
def test_serve_root_path_that_cannot_match_is_one_line(tiny_bundle, value, words, capsys):
    from lineside.cli import run_app
    from tests.server.test_units import _cli

    code = run_app(_cli(), ["serve", str(tiny_bundle), "--root-path", value])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "--root-path" in err and words in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/prefill"])
def test_a_number_too_long_to_read_is_named_as_such(server, path):
    """Python's json refuses an integer of more than 4,300 digits (a denial-of-service guard): the body is valid JSON
    in UTF-8, so the answer must name the number, not ask for what was sent."""
    body = b'{"prompt": "x", "session_id": "s", "max_tokens": 1' + b"0" * 5000 + b"}"
    with httpx.Client(base_url=server.url, timeout=30) as c:
        e = _error(c.post(path, content=body, headers=JSON), 400, "invalid_json")
    assert "digits" in e["message"] and "UTF-8" not in e["message"], e


@pytest.mark.parametrize("path", ["/health", "/health/ready", "/v1/models", "/metrics", "/version"])
def test_head_on_a_get_route_answers_as_get_without_a_body(server, path):
    """Load balancers and uptime checkers probe with HEAD: the GET's status and headers, no body (not a 405)."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        got, head = c.get(path), c.head(path)
    assert head.status_code == got.status_code == 200, (head.status_code, head.text)
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # the scrape's own counters move between the two
        assert head.headers["content-length"] == got.headers["content-length"]


def test_head_on_a_post_route_is_a_405_naming_head(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.head("/v1/chat/completions")
        assert r.status_code == 405 and r.content == b"" and r.headers["allow"] == "POST"
        assert c.head("/v1/nowhere").status_code == 404


def test_head_keeps_the_key_and_the_readiness(tiny_bundle):
    from tests.server.conftest import make_engine, running_server

    with running_server(make_engine(tiny_bundle, num_slots=1), api_key="k") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.head("/v1/models")
        assert r.status_code == 401 and r.content == b"" and r.headers["www-authenticate"] == "Bearer"
        assert c.head("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        srv.state.draining = True
        try:  # a draining server leaves the load balancer's pool: HEAD sees the 503 GET does
            assert c.head("/health/ready").status_code == c.get("/health/ready").status_code == 503
        finally:
            srv.state.draining = False


def test_a_raw_head_ends_after_the_headers(server):
    """Over the wire the HEAD answer has a Content-Length and no body, so a keep-alive connection's next answer
    is not misread (a body sent after a HEAD would be)."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Connection: close\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and b"content-length: " in first.lower(), raw
    assert rest.startswith(b"HTTP/1.1 200"), raw  # the GET's answer follows the HEAD's headers at once
