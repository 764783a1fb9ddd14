"""`serve --host` as users paste it: a bracketed IPv6 address ('[::1]', from a URL), '::' (every address), and
a host with a port glued on (one line naming --port); the URL the server prints brackets an IPv6 host."""

from __future__ import annotations

import os
import socket

import pytest

from lineside.errors import LinesideError
from lineside.server.bind import bind_socket, url_of
from tests.cli.cli_run import run_cli


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")


@needs_ipv6
@pytest.mark.parametrize("host", ["::1", "[::1]", " [::1] "])
def test_an_ipv6_loopback_host_binds_bracketed_or_not(host):
    sock = bind_socket(host, 0)
    try:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"
        port = sock.getsockname()[1]
        with socket.create_connection(("::1", port), timeout=5):
            conn, _ = sock.accept()
            conn.close()
        assert url_of(sock.getsockname()) == f"http://[::1]:{port}"
    finally:
        sock.close()


@needs_ipv6
@pytest.mark.parametrize("host", ["::", "[::]"])
def test_the_ipv6_wildcard_binds_and_takes_ipv4_too(host):
    sock = bind_socket(host, 0)
    try:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::"
        port = sock.getsockname()[1]
        if not sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY):  # Linux's default: dual stack
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                sock.accept()[0].close()
    finally:
        sock.close()


def test_url_of_an_ipv4_address_is_plain():
    assert url_of(("127.0.0.1", 8000)) == "http://127.0.0.1:8000"


@pytest.mark.parametrize("host, words", [
    ("[::1]:8000", ["--host [::1] --port 8000"]),
    ("127.0.0.1:8000", ["--host 127.0.0.1 --port 8000"]),
    ("localhost:9000", ["--host localhost --port 9000"]),
    ("not a host", ["cannot be resolved"]),
    ("[::1", ["cannot be resolved"]),
    ("http://127.0.0.1:8000/", ["is a URL", "--host 127.0.0.1 --port 8000"]),
    ("http://[::1]/v1", ["is a URL", "--host [::1])"]),
])
def test_a_wrong_host_is_one_line(host, words):
    with pytest.raises(LinesideError) as e:
        bind_socket(host, 0).close()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_serve_help_names_the_ipv6_and_wildcard_hosts():
    """--help says what README says: IPv6 bracketed or not, and what 0.0.0.0 and :: bind."""
    shown = " ".join(run_cli("serve", "--help", env={**os.environ, "COLUMNS": "250"}).stdout.split())
    host = shown[shown.index("--host"):shown.index("--port")]
    for words in ("[::1]", "0.0.0.0 every IPv4 address", ":: (or [::]) every address", "no port or URL"):
        assert words in host, host
