"""Refusals made before a request reaches its route — the key (401), Host / Origin (403), body limits
(413 / 415), headers (431), loading and draining (503), connection limits (429 / 503) — carry the CORS headers an
allowed origin gets on success (else a browser sees an opaque network error), and are counted in
lineside_requests_total under an outcome of their own."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from lineside.server.http_limits import HttpLimits
from tests.server.conftest import make_engine, metric, running_server

ORIGIN = "http://dash.local:3000"
KEY = {"Authorization": "Bearer k"}
LIMITS = HttpLimits(max_header_count=20, max_connections_per_client=2, refusal_linger=0.5)


@pytest.fixture(scope="module")
def srv(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=1), limits=LIMITS, api_key="k", allowed_origins=[ORIGIN],
                        max_body_bytes=4096) as s:
        yield s


def _outcome(srv, outcome: str) -> float:
    for _ in range(100):  # just after the connection-limit test, until the server has seen its sockets close
        r = httpx.get(srv.url + "/metrics", headers=KEY, timeout=30)
        if r.status_code != 429:
            break
        time.sleep(0.05)
    text = r.text
    return metric(text, "lineside_requests_total", f'outcome="{outcome}"')


def _cors(r: httpx.Response) -> None:
    assert r.headers.get("access-control-allow-origin") == ORIGIN, (r.status_code, dict(r.headers))
    exposed = {h.strip() for h in r.headers.get("access-control-expose-headers", "").split(",")}
    assert "retry-after" in exposed and "x-request-id" in exposed, r.headers


def _refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text


URL = "/v1/completions"
BODY = {"prompt": "x", "max_tokens": 1}


@pytest.mark.parametrize("case, status, code, outcome", [
    ("no key", 401, "invalid_api_key", "unauthorized"),
    ("foreign host", 403, "host_not_allowed", "forbidden"),
    ("form body", 415, "unsupported_media_type", "invalid"),
    ("too large", 413, "body_too_large", "invalid"),
    ("draining", 503, "draining", "draining"),
    ("loading", 503, "not_ready", "not_ready"),
])
def test_an_early_refusal_carries_cors_and_is_counted(srv, case, status, code, outcome):
    headers = {"Origin": ORIGIN, **KEY}
    kw: dict = {"json": BODY}
    if case == "no key":
        headers.pop("Authorization")
    elif case == "foreign host":
        headers["Host"] = "evil.example"
    elif case == "form body":
        kw = {"content": b"prompt=x", "headers": {"Content-Type": "application/x-www-form-urlencoded"}}
    elif case == "too large":
        kw = {"json": {"prompt": "x" * 8000}}
    before = _outcome(srv, outcome)
    flag = {"draining": "draining", "loading": "ready"}.get(case)
    if flag is not None:
        setattr(srv.state, flag, flag == "draining")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.post(URL, **{**kw, "headers": {**headers, **kw.get("headers", {})}})
    finally:
        if flag is not None:
            setattr(srv.state, flag, flag != "draining")
    _refused(r, status, code)
    _cors(r)
    assert _outcome(srv, outcome) - before == 1, case


def test_a_foreign_origin_is_refused_without_cors_and_its_preflight_is_a_403(srv):
    before = _outcome(srv, "forbidden")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(URL, json=BODY, headers={"Origin": "http://evil.example", **KEY})
        _refused(r, 403, "origin_not_allowed")
        assert "access-control-allow-origin" not in r.headers
        pre = c.options(URL, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        _refused(pre, 403, "origin_not_allowed")
        assert "access-control-allow-origin" not in pre.headers
        ok = c.options("/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "HEAD",
                                              "Access-Control-Request-Headers": "authorization"})
        assert ok.status_code == 200 and "HEAD" in ok.headers["access-control-allow-methods"], ok.text
    assert _outcome(srv, "forbidden") - before == 2


def _raw(srv, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(request)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    return raw


def test_refusals_made_before_the_app_are_counted(srv):
    """431 (too many headers) and a malformed request line are refused by the HTTP protocol layer, before the app:
    counted as invalid, as the app's 400 / 413 / 415 are."""
    before = _outcome(srv, "invalid")
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(30))
    raw = _raw(srv, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + many + b"\r\n")
    assert raw.startswith(b"HTTP/1.1 431"), raw[:200]
    raw = _raw(srv, b"GET /v1/models HTTP/1.1 extra\r\nHost: 127.0.0.1\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 400"), raw[:200]
    assert _outcome(srv, "invalid") - before == 2


def test_a_connection_over_the_per_client_limit_is_counted(srv):
    before = _outcome(srv, "too_many_connections")
    held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            for _ in range(LIMITS.max_connections_per_client)]
    try:
        raw = _raw(srv, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 429"), raw[:200]
    finally:
        for s in held:
            s.close()
    assert _outcome(srv, "too_many_connections") - before == 1


def _cors_of(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("access-control-") or k == "vary"}


def _raw_headers(raw: bytes) -> dict[str, str]:
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head)}


def test_a_431_carries_the_cors_headers_the_app_would_send(srv):
    """The protocol layer refuses too many headers before the app runs: an allowed Origin read before the limit
    still gets the CORS headers the app gives it (else the browser reports a network error, not the 431)."""
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(30))
    start = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    app_refusal = httpx.post(srv.url + URL, json=BODY, headers={"Origin": ORIGIN}, timeout=30)  # a 401 (no key)
    assert app_refusal.status_code == 401 and _cors_of(dict(app_refusal.headers)), app_refusal.headers
    raw = _raw(srv, start + b"Origin: " + ORIGIN.encode() + b"\r\n" + many + b"\r\n")
    assert raw.startswith(b"HTTP/1.1 431"), raw[:200]
    assert _cors_of(_raw_headers(raw)) == _cors_of(dict(app_refusal.headers)), raw[:600]

    foreign = httpx.post(srv.url + URL, json=BODY, headers={"Origin": "http://evil.example", **KEY}, timeout=30)
    raw = _raw(srv, start + b"Origin: http://evil.example\r\n" + many + b"\r\n")
    assert raw.startswith(b"HTTP/1.1 431") and "access-control-allow-origin" not in _raw_headers(raw), raw[:600]
    assert _cors_of(_raw_headers(raw)) == _cors_of(dict(foreign.headers)), raw[:600]
    raw = _raw(srv, start + many + b"Origin: " + ORIGIN.encode() + b"\r\n\r\n")  # never read: the limit came first
    assert raw.startswith(b"HTTP/1.1 431") and not _cors_of(_raw_headers(raw)), raw[:600]


def test_a_431_carries_no_cors_when_none_is_configured(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=1), limits=LIMITS) as plain:
        many = b"".join(b"X-H%d: v\r\n" % i for i in range(30))
        raw = _raw(plain, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: " + ORIGIN.encode() + b"\r\n" + many
                   + b"\r\n")
    assert raw.startswith(b"HTTP/1.1 431") and not _cors_of(_raw_headers(raw)), raw[:600]
