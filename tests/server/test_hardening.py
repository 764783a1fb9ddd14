"""Hostile clients on loopback (issue 21): smuggling and bad chunks refused and the connection closed with
nothing after them run; slow heads, stalled bodies and idle connections closed within the configured
limits; a page-style request refused; strict types; an over-long prompt refused without tokenizing it;
a half-sent body at SIGTERM answered in OpenAI's shape."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from lineside.server.http_limits import HttpLimits
from tests.server.conftest import make_engine, running_server

LIMITS = HttpLimits(header_timeout=0.5, body_timeout=0.5, body_deadline=3.0, keep_alive_timeout=0.5,
                    max_header_bytes=8192, max_header_count=50)
BOUND = 10.0  # seconds: far past every limit above; a connection still open then was never closed


@pytest.fixture(scope="module")
def guarded(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=2), limits=LIMITS) as srv:
        yield srv


def _exchange(srv, *parts: bytes | float) -> tuple[list[bytes], bytes, bool]:
    """Send parts (a float: read for that long instead), then read until the server closes or BOUND passes:
    (status lines, bytes, closed)."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=BOUND)
    s.settimeout(0.05)
    got = bytearray()
    closed = False

    def read_for(seconds: float) -> None:
        nonlocal closed
        end = time.monotonic() + seconds
        while not closed and time.monotonic() < end:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            closed = not chunk
            got.extend(chunk)

    try:
        for p in parts:
            if closed:
                break
            if isinstance(p, float):
                read_for(p)
                continue
            try:
                s.sendall(p)
            except OSError:
                read_for(0.5)
                closed = True
        read_for(BOUND)
    finally:
        s.close()
    raw = bytes(got)
    return [ln for ln in raw.split(b"\r\n") if ln.startswith(b"HTTP/1.1 ")], raw, closed


def _completions(srv) -> int:
    return sum(srv.state.engine.stats().requests.values())


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
BODY = b'{"prompt": "x", "max_tokens": 1}'
SMUGGLED = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d" \
           b"\r\n\r\n%s" % (len(BODY), BODY)

BAD_FRAMING = {
    "CL + TE chunked": HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "TE chunked + CL": HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size 20 x F": HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"F" * 20 + b"\r\nabc",
    "chunk size 0x10": HEAD + b"Transfer-Encoding: chunked\r\n\r\n0x10\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size -1": HEAD + b"Transfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "two different CLs": HEAD + b"Content-Length: 2\r\nContent-Length: 40\r\n\r\n{}" + SMUGGLED,
    "CL with a sign": HEAD + b"Content-Length: +2\r\n\r\n{}" + SMUGGLED,
    "space before colon": HEAD + b"Transfer-Encoding : chunked\r\nContent-Length: 2\r\n\r\n{}" + SMUGGLED,
    "folded TE header": HEAD + b"Transfer-Encoding: identity\r\n chunked\r\nContent-Length: 2\r\n\r\n{}" + SMUGGLED,
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMING))
def test_bad_framing_is_refused_and_closed(guarded, case):
    before = _completions(guarded)
    lines, raw, closed = _exchange(guarded, BAD_FRAMING[case])
    assert closed, f"{case}: connection left open"
    assert lines and lines[0].startswith(b"HTTP/1.1 400"), (case, raw[:300])
    assert len(lines) == 1, f"{case}: a second request ran: {raw[:400]!r}"
    err = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "malformed_http" and set(err) == {"message", "type", "code", "param"}
    assert _completions(guarded) == before  # nothing reached the engine


def test_malformed_requests_do_not_flood_the_log(guarded, caplog):
    """Each malformed request was one INFO line: a client opening connections in a loop wrote the device's log
    as fast as it liked. They are counted and sampled as refused connections are."""
    import logging

    caplog.set_level(logging.INFO, logger="lineside.server")
    for _ in range(30):
        lines, raw, closed = _exchange(guarded, BAD_FRAMING["CL + TE chunked"])
        assert closed and lines[0].startswith(b"HTTP/1.1 400"), raw[:200]
    logged = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(logged) <= 2 and all("so far" in m for m in logged), logged


@pytest.mark.parametrize("head", [
    b"X-Big: " + b"a" * 9000 + b"\r\n",
    b"".join(b"X-H%d: v\r\n" % i for i in range(60)),
    b"Cookie: " + b"c=1; " * 2000 + b"\r\n",
])
def test_oversized_headers_are_431(guarded, head):
    lines, raw, closed = _exchange(guarded, HEAD + head + b"Content-Length: 2\r\n\r\n{}")
    assert closed and lines and lines[0].startswith(b"HTTP/1.1 431"), raw[:200]
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"


@pytest.mark.parametrize("parts,status", [
    ((HEAD,), b"408"),  # a head never finished
    ((b"P", 0.3, b"O", 0.3, b"S", 0.3, b"T"), b"408"),  # a head trickled in byte by byte
    ((HEAD + b"Content-Length: 100\r\n\r\n" + b"x" * 10,), b"408"),  # a body that stalls
    ((b"",), None),  # connected, sent nothing: closed without a word
])
def test_slow_clients_are_cut_off(guarded, parts, status):
    t0 = time.monotonic()
    lines, raw, closed = _exchange(guarded, *parts)
    assert closed and time.monotonic() - t0 < BOUND
    if status is None:
        assert raw == b""
    else:
        assert lines and lines[0][9:12] == status, raw[:200]
        assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_body_trickling_forever_meets_the_body_deadline(guarded):
    drip = [HEAD + b"Content-Length: 1000\r\n\r\n"] + [b"x", 0.3] * 20  # progress every 0.3 s, 6 s in all
    lines, raw, closed = _exchange(guarded, *drip)
    assert closed and lines and lines[0].startswith(b"HTTP/1.1 408"), raw[:200]


def test_idle_keep_alive_is_closed_and_a_normal_request_still_served(guarded):
    request = HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    lines, raw, closed = _exchange(guarded, request)
    assert closed and len(lines) == 1 and lines[0].startswith(b"HTTP/1.1 200"), raw[:300]


def test_answers_announce_the_keep_alive_timeout(guarded):
    """Node's http.Agent (axios, Node-RED, got: keepAlive on, 5 s idle by default since Node 19) reused a socket the
    server was closing at the same 5 s and failed with ECONNRESET (seen polling every ~5 s); it, undici (the fetch
    the OpenAI JS SDK uses) and others close an idle socket ahead of a server's ``Keep-Alive: timeout=N``, as Node's
    own server and Apache send it. N is whole seconds, never more than the server waits."""
    from lineside.server.http_limits import uvicorn_config

    r = httpx.get(guarded.url + "/health")
    assert r.status_code == 200 and r.headers.get("keep-alive") == "timeout=0"  # 0.5 s: no socket is worth keeping
    config = uvicorn_config(None, host="127.0.0.1", port=0, limits=HttpLimits(keep_alive_timeout=75.9))
    assert ("keep-alive", "timeout=75") in config.headers


def test_a_request_answered_before_its_body_arrived_does_not_hold_the_connection(guarded):
    """A 404 is answered without reading the body: the body sent after it was left on a connection no timer
    watched (held open for good), and a body never sent got a 408 after the 404 (two answers to one request)."""
    head = b"POST /nothing HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n"
    for parts in ((head, 0.3, b"{}"), (head,)):
        _lines, raw, closed = _exchange(guarded, *parts)
        assert closed, f"{len(parts)} parts: connection left open"
        assert raw.startswith(b"HTTP/1.1 404") and raw.count(b"HTTP/1.1 ") == 1, raw[:600]


def test_h2c_upgrade_offer_is_served_as_http11(guarded):
    """curl --http2 on http:// offers an h2c upgrade: answered once, in HTTP/1.1; nothing after it is parsed."""
    offer = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
             b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
    before = _completions(guarded)
    lines, raw, closed = _exchange(guarded, offer + SMUGGLED)
    assert [ln[9:12] for ln in lines] == [b"200"], raw[:400]
    assert _completions(guarded) == before


def test_request_without_host_header_is_named_as_such(guarded):
    """HTTP/1.0 lets a client leave Host out: the 403 says so (it read "Host None is not one ...")."""
    lines, raw, _ = _exchange(guarded, b"GET /health HTTP/1.0\r\n\r\n")
    assert lines and lines[0][9:12] == b"403", raw[:300]
    assert b"without a Host header" in raw and b"None" not in raw, raw[:400]


def _split_answers(raw: bytes) -> tuple[bytes, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.lower(), body


STREAM = b'{"prompt": "x", "max_tokens": 3, "stream": true}'


def test_a_stream_to_an_http10_client_is_not_chunked(guarded):
    """HTTP/1.0 has no chunked coding (a 1.0 client shows the chunk sizes as text): the stream goes unframed and
    ends when the server closes the connection; a 1.0 answer with a known length still carries Content-Length."""
    request = (b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(STREAM), STREAM))
    _lines, raw, closed = _exchange(guarded, request)
    head, body = _split_answers(raw)
    assert closed and head.startswith(b"http/1.1 200"), raw[:300]
    assert b"transfer-encoding" not in head and b"content-length" not in head and b"connection: close" in head, head
    events = [e for e in body.split(b"\n\n") if e]
    assert events and all(e.startswith(b"data: ") for e in events), body[:300]
    assert events[-1] == b"data: [DONE]" and json.loads(events[0][6:])["object"] == "text_completion", body[-300:]

    plain = (b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
    _lines, raw, closed = _exchange(guarded, plain)
    head, body = _split_answers(raw)
    assert closed and head.startswith(b"http/1.1 200") and b"transfer-encoding" not in head, raw[:300]
    assert f"content-length: {len(body)}".encode() in head.split(b"\r\n"), raw[:300]
    assert json.loads(body)["object"] == "text_completion"


def test_a_stream_to_an_http11_client_stays_chunked_and_keeps_the_connection(guarded):
    """HTTP/1.1 is unchanged: the stream is chunked and the connection serves the next (pipelined) request."""
    request = HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(STREAM), STREAM)
    lines, raw, _closed = _exchange(guarded, request + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert [ln[9:12] for ln in lines] == [b"200", b"200"], raw[:600]
    head, body = _split_answers(raw)
    assert b"transfer-encoding: chunked" in head and b"connection: close" not in head, head
    assert b"\r\n0\r\n\r\nHTTP/1.1 200" in body, body[-400:]


# ---- browsers --------------------------------------------------------------------------------------------
def test_page_style_requests_are_refused(guarded):
    url = guarded.url + "/v1/completions"
    body = {"prompt": "x", "max_tokens": 1}
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost.", "", "[::1]evil.example"):
        r = httpx.post(url, json=body, headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
    for host in (f"localhost:{guarded.port}", f"127.0.0.1:{guarded.port}", f"[::1]:{guarded.port}", "LOCALHOST"):
        assert httpx.post(url, json=body, headers={"Host": host}).status_code == 200, host
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{guarded.port + 1}"):
        r = httpx.post(url, json=body, headers={"Origin": origin})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", origin
    r = httpx.get(guarded.url + "/health", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403  # a foreign page reads nothing, probes included
    r = httpx.post(url, content=json.dumps(body), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(guarded.url + path).status_code == 404, path


def test_allowed_origin_gets_cors_and_others_do_not(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=1), allowed_origins=["http://dash.local:3000"],
                        api_key="k") as srv:
        url, key = srv.url + "/v1/completions", {"Authorization": "Bearer k"}
        pre = httpx.options(url, headers={"Origin": "http://dash.local:3000", "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://dash.local:3000"
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://dash.local:3000", **key})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://dash.local:3000"
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://dash.local:3001", **key})
        assert r.status_code == 403
        # a preflight (above) carries no key and is answered by CORS; any other OPTIONS needs the key like every
        # path (it reached the routes without one, whose 405 lists their methods)
        for headers in ({}, {"Origin": "http://dash.local:3000"}):
            r = httpx.options(url, headers=headers)
            assert r.status_code == 401 and "allow" not in r.headers, (headers, r.status_code, r.headers)


# What a browser asks before the official OpenAI JS SDK's first call (openai 6.x, dangerouslyAllowBrowser): its
# platform headers, the retry count and timeout, the organization/project a caller may set.
_JS_SDK_HEADERS = ("authorization, content-type, openai-organization, openai-project, x-stainless-arch, "
                   "x-stainless-lang, x-stainless-os, x-stainless-package-version, x-stainless-retry-count, "
                   "x-stainless-runtime, x-stainless-runtime-version, x-stainless-timeout")


def test_allowed_origin_takes_the_openai_js_sdk(tiny_bundle):
    """A dashboard page on an allowed origin calling through the OpenAI JS SDK: its preflight passes, and its
    retry logic can read Retry-After and x-should-retry (a browser hides response headers CORS doesn't expose)."""
    origin = "http://dash.local:3000"
    with running_server(make_engine(tiny_bundle, num_slots=1), allowed_origins=[origin]) as srv:
        url = srv.url + "/v1/chat/completions"
        pre = httpx.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": _JS_SDK_HEADERS})
        assert pre.status_code == 200, pre.text
        allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
        assert {h.strip() for h in _JS_SDK_HEADERS.split(",")} <= allowed
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                       headers={"Origin": origin, "X-Stainless-Retry-Count": "0"})
        assert r.status_code == 200
        exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
        assert {"x-request-id", "retry-after", "x-should-retry"} <= exposed


def test_non_loopback_bind_takes_allowed_hosts():
    from lineside.server.browser_guard import BrowserPolicy

    assert BrowserPolicy.for_bind("0.0.0.0").host_allowed("anything:8000")  # a LAN server: names it cannot know
    p = BrowserPolicy.for_bind("0.0.0.0", ["orin.plant.local", "10.0.0.5"])
    assert p.host_allowed("orin.plant.local:8000") and p.host_allowed("10.0.0.5")
    assert not p.host_allowed("localhost:8000") and not p.host_allowed(None)
    assert BrowserPolicy.for_bind("127.0.0.2").host_allowed("127.0.0.2:9")


@pytest.mark.parametrize(("option", "value", "words"), [
    # never equal to a browser's Origin (scheme://host[:port]) or a Host name: every call refused, no word why
    ("--allowed-origins", "dash.local:3000", "http://dash.local:3000"),
    ("--allowed-origins", "http://dash.local:3000/app", "scheme://host[:port]"),
    ("--allowed-hosts", "orin.plant.local:8000", "without the port"),
])
def test_browser_lists_that_can_never_match_are_one_line(tiny_bundle, option, value, words):
    from tests.cli.cli_run import assert_one_line_error, run_cli

    assert_one_line_error(run_cli("serve", str(tiny_bundle), "--port", "1", option, value), option, words)


def test_browser_list_forms_that_match():
    """The forms the check takes are ones a browser's Host / Origin can equal (it only passed them before)."""
    from lineside.server.browser_guard import BrowserPolicy, check_browser_lists

    hosts, origins = ["orin.plant.local", "10.0.0.5", "::1", "[fe80::1]"], ["http://dash.local:3000", "https://dash.local/"]
    check_browser_lists([*hosts, "*"], [*origins, "*"])
    policy = BrowserPolicy.for_bind("0.0.0.0", hosts, origins)
    for sent in ("orin.plant.local:8000", "10.0.0.5", "[::1]:8000", "[fe80::1]:8000"):
        assert policy.host_allowed(sent), sent
    assert policy.origin_allowed("http://dash.local:3000") and policy.origin_allowed("https://dash.local")


@pytest.mark.parametrize("value", ["[fe80::1]:8000", "[::1]:80"])
def test_a_bracketed_ipv6_host_with_a_port_is_refused(value):
    """A port after a bracketed IPv6 address slipped past the check (two or more colons read as an address): the
    name kept was 'fe80::1]:8000', which no Host equals, and every call was a 403."""
    from lineside.errors import LinesideError
    from lineside.server.browser_guard import check_browser_lists

    with pytest.raises(LinesideError, match="without the port") as e:
        check_browser_lists([value], [])
    assert "\n" not in str(e.value)


# ---- strict types and the body's encoding -----------------------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": True}, "max_tokens"), ({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"),
    ({"top_k": 10**400}, "top_k"), ({"top_k": 2**31}, "top_k"), ({"n": True}, "n"), ({"seed": "7"}, "seed"),
    ({"temperature": "0.5"}, "temperature"), ({"max_tokens": 10**30}, "max_tokens"), ({"echo": "false"}, "echo"),
    ({"user": 5}, "user"), ({"stop": [1]}, "stop"),
])
def test_strict_types_name_the_field(guarded, extra, param):
    body = json.dumps({"prompt": "x", **extra})
    r = httpx.post(guarded.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_bodies_are_refused(guarded, encoding):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode(encoding)
    r = httpx.post(guarded.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_utf8", r.text


# ---- length before tokenizing ----------------------------------------------------------------------------
def test_overlong_prompts_are_refused_without_tokenizing(guarded, monkeypatch):
    from lineside.server.prompt_limits import text_bound

    tok = guarded.state.engine.tokenizer
    calls = []
    for name in ("encode", "encode_chat"):
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    bound = text_bound(tok, guarded.state.engine.max_seq_len)
    huge = "ab " * (bound // 3 + 1)
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/completions", {"prompt": ["ok", huge]}, "prompt.1"),  # which of several
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge[: bound // 2]},
                                                                     {"role": "user", "content": huge}]}, "messages")):
        r = httpx.post(guarded.url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        assert r.json()["error"]["param"] == param
    assert calls == []  # refused from the length alone
    r = httpx.post(guarded.url + "/v1/completions", json={"prompt": "x" * 300, "max_tokens": 2})
    assert r.status_code == 400 and "301 tokens" in r.json()["error"]["message"] and calls  # under it: tokenized


def test_prompt_just_under_the_text_bound_is_refused_after_a_few_pieces(guarded):
    """A prompt the character bound lets through but the context cannot hold: counted in pieces and refused once
    the count passes the context, having read a small part of it (the message says how much)."""
    import re

    from lineside.runtime.bounded_encode import piece_chars
    from lineside.server.prompt_limits import text_bound

    engine = guarded.state.engine
    bound = text_bound(engine.tokenizer, engine.max_seq_len)
    words = "sensor 42 reads 3.14 bar, torque ok; line\tstation".split(" ")
    text = " ".join(words[i % len(words)] + str(i % 89) for i in range(bound))[: bound - 10]
    for path, body, param in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
                              ("/v1/completions", {"prompt": text}, "prompt")):
        r = httpx.post(guarded.url + path, json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, r.text
        read = int(re.search(r"first (\d+) characters", err["message"]).group(1))
        assert read <= piece_chars(engine.max_seq_len) + 32 < len(text) // 2, err["message"]  # + the rest of a word


def test_text_bound_is_safe_for_every_token():
    """No single token stands for more characters than the bound assumes (else a fitting prompt is refused)."""
    import tempfile
    from pathlib import Path

    from lineside.runtime.tokenizer import Tokenizer
    from lineside.server.prompt_limits import max_token_chars
    from tests.server.test_special_tokens import FAMILIES, _write  # noqa: PLC0415 - a sibling's writer

    tok, hf, _ = _write(Path(tempfile.mkdtemp()), FAMILIES["chatml"])
    assert isinstance(tok, Tokenizer)
    longest = max(len(hf.decode([i], skip_special_tokens=False)) for i in range(hf.get_vocab_size()))
    assert max_token_chars(tok) >= longest


def test_broken_tokenizer_json_is_one_line_naming_the_file(tmp_path):
    from lineside.errors import BundleError
    from lineside.runtime.tokenizer import Tokenizer

    for text in ('{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}', "not json", ""):
        (tmp_path / "tokenizer.json").write_text(text)
        with pytest.raises(BundleError) as e:
            Tokenizer(tmp_path)
        msg = str(e.value)
        assert str(tmp_path / "tokenizer.json") in msg and "\n" not in msg and "rebuild" in msg


# ---- SIGTERM with a half-sent body -----------------------------------------------------------------------
def test_sigterm_with_half_sent_body(tiny_bundle):
    from lineside.bench.inprocess import free_port, wait_ready

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LINESIDE_API_KEY", None)
    drain = 3.0
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(tiny_bundle), "--port", str(port),
                             "--threads", "1", "--drain-timeout", str(drain), "--body-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 60, alive=lambda: proc.poll() is None)
        s = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
        s.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "')
        time.sleep(0.3)  # the request is in flight, waiting for the rest of its body
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        s.close()
        assert proc.wait(timeout=drain + 10) == 0
        assert time.monotonic() - t0 < drain + 1.0
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), got[:300]
        err = json.loads(body)["error"]
        assert err["code"] == "draining" and set(err) == {"message", "type", "code", "param"}
        log = proc.stdout.read()
        assert "Traceback" not in log and "ERROR" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_body_limit_follows_the_context(guarded):
    """Without --max-body-bytes, a body far beyond what the context can use is a 413 from its Content-Length."""
    from lineside.server.prompt_limits import body_limit

    engine = guarded.state.engine
    limit = body_limit(engine.tokenizer, engine.max_seq_len)
    assert limit < 32 << 20  # the tiny model's context makes far less worth reading than the old fixed 32 MiB
    r = httpx.post(guarded.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "a" * (limit + 1)}]})
    assert r.status_code == 413 and str(limit) in r.json()["error"]["message"]


def test_api_key_sources(tmp_path, monkeypatch, caplog):
    from lineside.errors import LinesideError
    from lineside.server.auth import resolve_api_key

    monkeypatch.delenv("LINESIDE_API_KEY", raising=False)
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    assert resolve_api_key(None, key) == "s3cret"
    assert resolve_api_key(None, None) is None
    monkeypatch.setenv("LINESIDE_API_KEY", "")  # set but empty (typer passes no value): refused, not served open
    with pytest.raises(LinesideError) as e:
        resolve_api_key(None, None)
    assert "LINESIDE_API_KEY is set but empty" in str(e.value) and "\n" not in str(e.value)
    assert resolve_api_key(None, key) == "s3cret"  # a key file given beside it wins
    monkeypatch.setenv("LINESIDE_API_KEY", "from-env")
    caplog.clear()
    assert resolve_api_key("from-env", None) == "from-env" and "ps" not in caplog.text  # typer passes the env value
    assert resolve_api_key("typed", None) == "typed" and "visible to every user in `ps`" in caplog.text
    (tmp_path / "two").write_text("a\nb\n")
    (tmp_path / "empty").write_text("\n")
    for args, needle in (((None, tmp_path / "missing"), "no such file"), ((None, tmp_path / "two"), "several lines"),
                         ((None, tmp_path / "empty"), "found nothing"), (("typed", key), "not both")):
        with pytest.raises(LinesideError) as e:
            resolve_api_key(*args)
        assert needle in str(e.value) and "\n" not in str(e.value)
    # the key as a client can send it: a secret mounted with its newline was kept whole, and no client's
    # (stripped) token matched it; a non-ASCII key is sent as UTF-8 bytes (if at all) and never matched either
    from lineside.server.auth import AccessPolicy

    for value in ("from-env\n", " from-env\r\n"):
        monkeypatch.setenv("LINESIDE_API_KEY", value)
        resolved = resolve_api_key(value, None)  # typer passes the env value
        assert resolved == "from-env" and AccessPolicy(resolved).key_matches("Bearer from-env")[0]
    (tmp_path / "accent").write_text("clé\n")
    for args in (("clé", None), (None, tmp_path / "accent"), ("a\tb", None)):
        with pytest.raises(LinesideError, match="printable ASCII") as e:
            resolve_api_key(*args)
        assert "\n" not in str(e.value) and "clé" not in str(e.value)  # the key itself is never printed


@pytest.mark.parametrize("extra,needle", [
    (["--header-timeout", "0"], "--header-timeout"), (["--body-timeout", "-1"], "--body-timeout"),
    (["--keep-alive-timeout", "0"], "--keep-alive-timeout"), (["--tokenizer-processes", "-1"], "--tokenizer-processes"),
    (["--send-timeout", "0"], "--send-timeout"),
    (["--api-key-file", "/no/such/key"], "--api-key-file"),
])
def test_serve_hardening_options_fail_in_one_line(tiny_bundle, extra, needle, capsys):
    from lineside.cli import run_app
    from tests.server.test_units import _cli

    code = run_app(_cli(), ["serve", str(tiny_bundle), *extra])  # as `lineside` runs it: ranges are usage errors
    err = capsys.readouterr().err.strip()
    assert code in (1, 2) and needle in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("damage,words", [
    ("truncate", ["graphs/cpu/model.onnx.data", "bytes, the manifest says", "copy the bundle again"]),
    ("delete", ["tokenizer/tokenizer.json", "missing", "copy the bundle again"]),
])
def test_serve_refuses_a_damaged_bundle_before_binding(tiny_bundle, tmp_path, monkeypatch, capsys, damage, words):
    """The model loads in the background once the socket is bound: a file the manifest lists that is missing or
    of another size is one line before that ("serving on ..." never shows), checked by size only (the load
    still verifies checksums)."""
    import shutil

    from lineside.cli import run_app
    from lineside.errors import LinesideError
    from tests.server.test_units import _cli

    b = tmp_path / "b"
    shutil.copytree(tiny_bundle, b)
    if damage == "truncate":
        data = b / "graphs/cpu/model.onnx.data"
        data.write_bytes(data.read_bytes()[:-4])
    else:
        (b / "tokenizer/tokenizer.json").unlink()

    def bound(*_a, **_k):
        raise LinesideError("bound the socket before checking the bundle's files")

    monkeypatch.setattr("lineside.server.bind.bind_socket", bound)
    code = run_app(_cli(), ["serve", str(b)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_tokenizer_worker_is_niced_and_stops_early(tiny_bundle):
    """The worker process runs below the server's priority, returns the tokenizer's own ids for a long prompt
    that fits, and a PromptTooLong (not a traceback) for one that does not."""
    from lineside.bundle import open_bundle
    from lineside.runtime.bounded_encode import PromptTooLong
    from lineside.runtime.tokenizer import Tokenizer
    from lineside.server.tokenize_pool import PooledTokenizer, worker_niceness

    inner = Tokenizer.from_bundle(open_bundle(tiny_bundle))
    pooled = PooledTokenizer(inner, processes=1, inline_chars=100)
    try:
        pooled.warm()
        nice = worker_niceness()
        assert nice > 0 and pooled.processes == 1
        assert pooled.worker_priority == min(os.getpriority(os.PRIO_PROCESS, 0) + nice, 19)
        text = "torque ok at station 7; " * 40
        assert pooled.encode(text, max_tokens=10**6) == inner.encode(text)
        msgs = [{"role": "user", "content": text}]
        assert pooled.encode_chat(msgs, max_tokens=10**6) == inner.encode_chat(msgs)
        with pytest.raises(PromptTooLong) as e:
            pooled.encode_chat(msgs, max_tokens=50)
        assert e.value.limit == 50 and e.value.tokens > 50
    finally:
        pooled.close()


# ---- connection counts --------------------------------------------------------------------------------------
CONN_LIMITS = HttpLimits(header_timeout=5.0, keep_alive_timeout=5.0, max_connections_per_client=3, max_connections=4,
                         refusal_linger=0.5)


def _connect(srv, source: str) -> socket.socket:
    s = socket.socket()
    s.settimeout(BOUND)
    s.bind((source, 0))
    s.connect(("127.0.0.1", srv.port))
    return s


def _held(srv, source: str) -> socket.socket:
    """A keep-alive connection the server has admitted (it answered one request on it) and still holds open."""
    s = _connect(srv, source)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
        got += s.recv(65536)
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    return s


def _refused(srv, source: str) -> tuple[bytes, dict]:
    s = _connect(srv, source)
    try:
        s.sendall(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    finally:
        s.close()
    head, _, body = got.partition(b"\r\n\r\n")
    return head, json.loads(body)["error"]


def test_connections_per_client_and_in_all_are_capped(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=1), limits=CONN_LIMITS) as srv:
        before = _completions(srv)
        mine = [_held(srv, "127.0.0.1") for _ in range(3)]
        head, err = _refused(srv, "127.0.0.1")  # a 4th from the same address
        assert head.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in head.lower(), head
        assert err["code"] == "too_many_connections" and "127.0.0.1" in err["message"]
        assert set(err) == {"message", "type", "code", "param"} and "\n" not in err["message"]
        other = _held(srv, "127.0.0.2")  # another client still gets in: 4 open in all
        head, err = _refused(srv, "127.0.0.3")  # the 5th in all: the global cap
        assert head.startswith(b"HTTP/1.1 503") and err["code"] == "server_busy", head
        assert _completions(srv) == before  # nothing refused reached the engine
        silent = _connect(srv, "127.0.0.1")  # over the limit and sending nothing: closed after the linger
        t0 = time.monotonic()
        assert silent.recv(100) == b"" and time.monotonic() - t0 < BOUND
        silent.close()
        mine.pop().close()
        time.sleep(0.2)  # the server sees the close
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200  # a slot freed: the same address is served again
        for s in [*mine, other]:
            s.close()
        assert srv.app  # the counts above are per server: other servers' tests are untouched


def test_uvicorn_internals_the_guard_relies_on(monkeypatch):
    """The guard overrides uvicorn's httptools protocol; if a uvicorn release renames what it uses, this fails
    with one line saying what and which versions to install (pyproject pins the tested range)."""
    import asyncio

    import uvicorn

    from lineside.errors import LinesideError
    from lineside.server.http_limits import check_uvicorn, protocol_class

    check_uvicorn(strict_version=True)  # the installed uvicorn is in the tested range and has every method
    from pathlib import Path

    from lineside.server.http_limits import UVICORN_TESTED

    (lo_major, lo_minor), (hi_major, hi_minor) = UVICORN_TESTED
    pin = f'"uvicorn>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"'
    assert pin in (Path(__file__).parents[2] / "pyproject.toml").read_text(), f"pyproject must pin {pin}"

    async def app(scope, receive, send):  # pragma: no cover - never called: the head is only parsed
        pass

    class Transport(asyncio.Transport):
        def __init__(self):
            super().__init__()
            self.out = b""
            self.closing = False

        def get_extra_info(self, name, default=None):
            return {"peername": ("127.0.0.1", 5), "sockname": ("127.0.0.1", 8000)}.get(name, default)

        def write(self, data):
            self.out += data

        def is_closing(self):
            return self.closing

        def close(self):
            self.closing = True

    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(app, lifespan="off")
        server_state = uvicorn.server.ServerState()
        proto = protocol_class(HttpLimits())(config=config, server_state=server_state, app_state={}, _loop=loop)
        proto.connection_made(Transport())
        proto.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        check_uvicorn(proto)  # every attribute it reads exists on a connection with a request under way
        proto.connection_lost(None)
    finally:
        tasks = asyncio.all_tasks(loop)  # the app's task uvicorn started for that head: never to run
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()
    with pytest.raises(LinesideError) as e:
        check_uvicorn(object())  # what a changed protocol looks like
    msg = str(e.value)
    assert "protocol.parser" in msg and "cycle.response_complete" in msg and "uvicorn>=" in msg and "\n" not in msg
    monkeypatch.setattr(uvicorn, "__version__", "0.99.0")  # a release past the tested range: the suite says so
    with pytest.raises(LinesideError, match=r"uvicorn 0\.99\.0 .* outside the tested range\); install uvicorn>=0\.30,<0\.55"):
        check_uvicorn(strict_version=True)
    check_uvicorn()  # serve itself only warns
