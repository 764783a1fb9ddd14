"""Inputs nobody wrote down: hypothesis generates framings, chunk sizes, Host / Origin values and field types
of the classes in test_hardening, and the same rules must hold for all of them: never a 5xx, a refused
message closes its connection with nothing after it run, only allowed hosts and origins get through,
and a value of the wrong JSON type is a 400 naming its field."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import make_engine, running_server
from tests.server.test_hardening import BODY, HEAD, LIMITS, _exchange

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
FOLLOWER = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def srv(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=2), limits=LIMITS) as s:
        yield s


_hex = st.text("0123456789abcdefABCDEF", min_size=1, max_size=24)
_junk = st.sampled_from(["", " ", "\t", ";ext", ";a=b", "x", "-", "+", "0x", "\x00", " ;", "\r"])
_chunk_line = st.builds(lambda pre, h, post: (pre + h + post).encode("latin-1"), _junk, _hex, _junk)
_te = st.sampled_from(["chunked", "Chunked", "chunked, chunked", "gzip, chunked", "identity", "chunked ", " chunked",
                       "chunked;q=1", "xchunked", "\tchunked"])
_cl = st.one_of(st.integers(0, 64).map(str), st.sampled_from(["", "-1", "+3", "1 2", "0x10", "3,3", "99999999999999999999"]))


@st.composite
def framings(draw) -> bytes:
    """A request with one of: chunked with a generated chunk-size line, TE and/or CL (maybe twice), a body."""
    headers = b""
    tes = draw(st.lists(_te, max_size=2))
    cls = draw(st.lists(_cl, max_size=2))
    for te in tes:
        headers += b"Transfer-Encoding: " + te.encode() + b"\r\n"
    for cl in cls:
        headers += b"Content-Length: " + cl.encode() + b"\r\n"
    body = draw(st.sampled_from([b"", BODY]))
    if tes:
        body = draw(_chunk_line) + b"\r\n" + body + b"\r\n0\r\n\r\n"
    return HEAD + headers + b"\r\n" + body


@given(raw=framings())
@SETTINGS
def test_generated_framings(srv, raw):
    lines, got, closed = _exchange(srv, raw + FOLLOWER)
    statuses = [int(ln[9:12]) for ln in lines]
    assert all(s < 500 for s in statuses), got[:300]
    first_body = got.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in got else b""
    if b'"malformed_http"' in first_body.split(b"HTTP/1.1 ", 1)[0]:
        # a message the server could not frame: refused, closed, nothing after it answered
        assert closed and len(statuses) == 1, got[:400]


_label = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
_hosts = st.one_of(
    st.builds(lambda a, b: f"{a}.{b}", _label, _label),
    st.sampled_from(["localhost", "127.0.0.1", "::1", "[::1]", "LocalHost", "localhost.", "127.0.0.2", "0.0.0.0",
                     "127.0.0.1.nip.io", "localhost.evil", "[::ffff:127.0.0.1]", "127.1", "2130706433", ""]),
)


@given(host=_hosts, port=st.one_of(st.none(), st.integers(1, 65535)))
@SETTINGS
def test_generated_host_headers(srv, host, port):
    value = host if port is None else f"{host}:{port}"
    r = httpx.get(srv.url + "/v1/models", headers={"Host": value})
    name = host.lower().strip("[]")
    bare_v6_with_port = port is not None and host == "::1"  # not a valid Host: IPv6 needs brackets before a port
    if name in ("localhost", "127.0.0.1", "::1") and not bare_v6_with_port:
        assert r.status_code == 200, value
    else:
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", value


@given(origin=st.one_of(st.builds(lambda s, h: f"{s}://{h}", st.sampled_from(["http", "https", "file", "null"]), _hosts),
                        st.sampled_from(["null", "", "*"])))
@SETTINGS
def test_generated_origins_are_refused(srv, origin):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Origin": origin})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", origin


_INT_FIELDS = ["max_tokens", "n", "top_k", "seed", "best_of"]
_BOOL_FIELDS = ["stream", "echo"]
_FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
_wrong_for_int = st.one_of(st.booleans(), st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False).filter(
    lambda f: f != int(f)), st.lists(st.integers(), max_size=2), st.integers(min_value=2**63))
_wrong_for_bool = st.one_of(st.integers(), st.text(max_size=5), st.floats(allow_nan=False), st.none().map(lambda _: [0]))
_wrong_for_float = st.one_of(st.booleans(), st.text(max_size=5), st.lists(st.floats(), max_size=1))


@given(data=st.data())
@SETTINGS
def test_generated_wrong_types_name_the_field(srv, data):
    kind = data.draw(st.sampled_from(["int", "bool", "float"]))
    field = data.draw(st.sampled_from({"int": _INT_FIELDS, "bool": _BOOL_FIELDS, "float": _FLOAT_FIELDS}[kind]))
    value = data.draw({"int": _wrong_for_int, "bool": _wrong_for_bool, "float": _wrong_for_float}[kind])
    body = json.dumps({"prompt": "x", "max_tokens": 1, field: value})
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (field, value, r.text[:200])
    assert r.json()["error"]["param"] == field, (field, value, r.json())
