"""The listening socket `serve` opens before any work: a busy or privileged port, or a host that is not this
machine's, is one line — and it imports no web stack, so the model starts loading right after."""

from __future__ import annotations

import errno
import socket

from lineside.errors import LinesideError


def bind_error_line(host: str, port: int, exc: OSError) -> str:
    """What a failed bind means and what to do, in one line (EADDRINUSE, EACCES, EADDRNOTAVAIL, a bad host)."""
    where = f"{host}:{port}"
    if isinstance(exc, socket.gaierror) or exc.errno in (errno.EAFNOSUPPORT,):
        return (f"--host {host!r} cannot be resolved ({exc.strerror or exc}); give an address of this machine, "
                "e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (the local network)")
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use (another server?); stop it or choose another --port")
    if exc.errno in (errno.EACCES, errno.EPERM):
        if port < 1024:
            return (f"port {port} is privileged (below 1024) and this user may not bind it; use --port 8000 "
                    "(or any port from 1024 up)")
        return f"not allowed to listen on {where} ({exc.strerror}); choose another --port or --host"
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host} is not an address of this machine; use 127.0.0.1, 0.0.0.0 or one of this "
                "machine's own addresses")
    return f"cannot listen on {where}: {exc.strerror or exc}; choose another --host or --port"


def bind_host(host: str) -> str:
    """The address to resolve from --host as users paste it: '[::1]' (a URL's bracketed IPv6) is '::1'; one
    with a port ('[::1]:8000', '127.0.0.1:8000') is one line naming --port, not a resolver error."""
    h = host.strip()
    if "://" in h:
        where = h.split("://", 1)[1].split("/", 1)[0]
        name, _, port = where.rpartition(":") if where.rpartition(":")[2].isdigit() else (where, "", "")
        raise LinesideError(f"--host {host!r} is a URL; give the address alone (--host {name}"
                            + (f" --port {port})" if port else ")"))
    if h.startswith("[") and h.endswith("]"):
        return h[1:-1].strip()
    if h.startswith("[") and "]:" in h:
        raise LinesideError(f"--host {host!r} holds a port; give the address alone and the port apart "
                            f"(--host {h[:h.index(']') + 1]} --port {h.rsplit(':', 1)[1]})")
    if h.count(":") == 1 and h.split(":")[1].isdigit():
        name, port = h.split(":")
        raise LinesideError(f"--host {host!r} holds a port; give the address alone and the port apart "
                            f"(--host {name} --port {port})")
    return h


def url_of(address: tuple) -> str:
    """http://host:port for a bound socket's address, an IPv6 host in brackets (http://[::1]:8000)."""
    host, port = address[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """Resolve, bind and listen before any work (the model is not loaded yet), so a busy port, a privileged
    port or a host that is not this machine's is one line (LinesideError), not uvicorn's log and exit 3."""
    host = bind_host(host)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise LinesideError(bind_error_line(host, port, e if isinstance(e, OSError) else OSError(str(e)))) from None
    family, kind, proto, _name, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: no TIME_WAIT refusals
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise LinesideError(bind_error_line(host, port, e)) from None
    sock.set_inheritable(True)
    return sock
