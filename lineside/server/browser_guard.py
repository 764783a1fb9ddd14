"""What keeps a web page from driving the server through a technician's browser: a Host allow-list (DNS
rebinding), a refused foreign Origin (cross-site posts), and JSON-only request bodies (a form or
``text/plain`` post needs no CORS preflight, so it must not be read as JSON)."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from lineside.errors import LinesideError
from lineside.server.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_loopback(host: str) -> bool:
    """True for a bind address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class BrowserPolicy:
    """``allowed_hosts``: Host names (no port) requests may name, None for any; ``allowed_origins``: exact
    browser origins (``scheme://host[:port]``) that may call, "*" for any; none by default."""

    allowed_hosts: frozenset[str] | None
    allowed_origins: frozenset[str] = frozenset()

    @classmethod
    def for_bind(cls, bind_host: str, allowed_hosts: list[str] | None = None,
                 allowed_origins: list[str] | None = None) -> BrowserPolicy:
        """Loopback names when bound to loopback; the given names otherwise (any Host when none are given and
        the bind is not loopback: a LAN server is reached by names it cannot know)."""
        hosts: frozenset[str] | None
        if allowed_hosts:
            names = {h.strip().lower().strip("[]") for h in allowed_hosts if h.strip()}
            hosts = None if "*" in names else frozenset(names)
        elif is_loopback(bind_host):
            hosts = LOOPBACK_NAMES | {bind_host.lower().strip("[]")}
        else:
            hosts = None
        origins = frozenset(o.strip().rstrip("/").lower() for o in allowed_origins or [] if o.strip())
        return cls(hosts, origins)

    def host_allowed(self, host_header: str | None) -> bool:
        if self.allowed_hosts is None:
            return True
        if not host_header:
            return False
        return host_name(host_header) in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/").lower() in self.allowed_origins


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port: 'localhost:8000' → 'localhost', '[::1]:80' → '::1'."""
    h = host_header.strip().lower()
    if h.startswith("["):  # '[::1]' or '[::1]:port'; '[::1]evil.com' is no name of ours
        close = h.find("]")
        return h[1:close] if close > 0 and h[close + 1:close + 2] in ("", ":") else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def json_content_type(value: str | None) -> str | None:
    """None when ``value`` is JSON in UTF-8 (application/json or */*+json, charset absent or utf-8); else why not."""
    if not value:
        return "the request has no Content-Type"
    media, _, params = value.partition(";")
    media = media.strip().lower()
    if not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))):
        return f"Content-Type {media!r} is not JSON"
    for p in params.split(";"):
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset" and v.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return f"charset {v.strip()!r} is not UTF-8"
    return None


def content_coding(value: str | None) -> str | None:
    """The first content coding other than identity in a Content-Encoding header, or None. The body is read as the
    bytes sent (as vLLM, llama.cpp's server and Ollama read it): a gzip body would otherwise be refused as UTF-16
    (its header holds NUL bytes) or malformed JSON, saying nothing of the compression (RFC 9110: 415)."""
    for coding in (value or "").split(","):
        name = coding.strip().lower()
        if name and name != "identity":
            return name
    return None


class BrowserGuard:
    """Pure-ASGI middleware applying a BrowserPolicy before anything else runs."""

    def __init__(self, app: Any, policy: BrowserPolicy, on_invalid: Callable[[dict], None] | None = None,
                 on_forbidden: Callable[[dict], None] | None = None):
        self.app = app
        self.policy = policy
        self.on_invalid = on_invalid  # told of each body refused as not JSON (415): the server counts it
        self.on_forbidden = on_forbidden  # told of each request refused for its Host or Origin (403)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = headers.get("host")
        if not self.policy.host_allowed(host):
            allowed = ", ".join(sorted(self.policy.allowed_hosts or ()))
            what = "a request without a Host header is" if not host else f"Host {host!r} is"
            self._forbidden(scope)
            await _refuse(send, 403, f"{what} not one this server answers to ({allowed}); send the server's name "
                                     "as Host, or start it with --allowed-hosts NAME to add one",
                          code="host_not_allowed")
            return
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_allowed(origin):
            self._forbidden(scope)
            await _refuse(send, 403, f"requests from the web origin {origin!r} are refused (cross-origin calls are "
                                     "off); start the server with --allowed-origins ORIGIN to allow one",
                          code="origin_not_allowed")
            return
        if scope.get("method") in _BODY_METHODS and _has_body(headers):
            why = json_content_type(headers.get("content-type"))
            if why is not None:
                self._invalid(scope)
                await _refuse(send, 415, f"{why}; send the body as JSON with 'Content-Type: application/json' "
                                         "(UTF-8)", code="unsupported_media_type")
                return
            coding = content_coding(headers.get("content-encoding"))
            if coding is not None:
                self._invalid(scope)
                await _refuse(send, 415, f"Content-Encoding {coding!r} is not accepted; send the body uncompressed "
                                         "(no Content-Encoding)", code="unsupported_content_encoding",
                              headers=[(b"accept-encoding", b"identity")])
                return
        await self.app(scope, receive, send)

    def _invalid(self, scope: dict) -> None:
        if self.on_invalid is not None:
            self.on_invalid(scope)

    def _forbidden(self, scope: dict) -> None:
        if self.on_forbidden is not None:
            self.on_forbidden(scope)


@dataclass(frozen=True)
class CorsSettings:
    """The CORS the app answers with (allowed origins, "*" for any; exposed headers), kept as a value so the HTTP
    protocol layer, which refuses some requests before the app runs (431), can add the same headers."""

    origins: tuple[str, ...]
    expose: tuple[str, ...] = ()

    def headers_for(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        """What Starlette's CORSMiddleware adds to a (non-preflight) answer for this request Origin: nothing
        without one; the exposed headers and ``Vary: Origin`` for any; the allowed origin echoed (or "*")."""
        if origin is None:
            return []
        headers: list[tuple[bytes, bytes]] = []
        if "*" in self.origins:
            headers.append((b"access-control-allow-origin", b"*"))
        elif origin in self.origins:
            headers.append((b"access-control-allow-origin", origin.encode("latin-1")))
        if self.expose:
            headers.append((b"access-control-expose-headers", ", ".join(self.expose).encode("latin-1")))
        headers.append((b"vary", b"Origin"))
        return headers


class GuardedCors(CORSMiddleware):
    """Starlette's CORS placed outside the BrowserGuard, so every refusal an allowed origin gets (403, 415, and the
    401/413/503 within) carries its CORS headers (a browser shows a refusal without them as an opaque network
    error); a preflight from a foreign origin goes on to the guard's OpenAI-shaped 403, not CORS's plain 400."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "OPTIONS":
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if origin is not None and "access-control-request-method" in headers and not self.is_allowed_origin(origin):
                await self.app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _has_body(headers: dict[str, str]) -> bool:
    """Whether the request carries a body (chunked, or a Content-Length other than 0). One without (the OpenAI JS
    SDK's ``responses.cancel``) holds nothing to misread as JSON: its route answers it, not a 415 asking for JSON."""
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() != "0"


async def _refuse(send: Any, status: int, message: str, *, code: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(APIError(status, message, code).body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


_ORIGIN = re.compile(r"^https?://[^/\s?#]+/?$")


def check_browser_lists(hosts: list[str], origins: list[str]) -> None:
    """--allowed-hosts are Host names without a port, --allowed-origins are scheme://host[:port] (what a browser
    sends); a value that can never equal one is one line here, not every call refused later without a word why."""
    for origin in origins:
        o = origin.strip()
        if o != "*" and not _ORIGIN.match(o):
            hint = f"e.g. http://{o.split('://')[-1].split('/')[0]}" if o else "e.g. http://dash.local:3000"
            raise LinesideError(f"--allowed-origins {origin!r}: an origin is scheme://host[:port] as the browser "
                                f"sends it, no path ({hint}), or '*'")
    for host in hosts:
        h = host.strip()
        bare = h.strip("[]")
        # name:port (an IPv6 address has two or more colons), or [address]:port
        bracketed_port = h.startswith("[") and "]" in h and not h.endswith("]")
        if (h.count(":") == 1 and not h.startswith("[")) or bracketed_port:
            name = h[:h.index("]") + 1] if bracketed_port else h.split(":")[0]
            raise LinesideError(f"--allowed-hosts {host!r}: give the host name without the port "
                                f"({name}); any port is allowed")
        if any(ch in bare for ch in "/ \t") or "://" in h:
            raise LinesideError(f"--allowed-hosts {host!r}: give a host name or address (e.g. orin.plant.local), "
                                "not a URL")
