"""Run the app under uvicorn with a graceful drain: on SIGTERM (or Ctrl-C) the server keeps listening but
answers 503 to new generation requests, lets in-flight ones finish for up to the drain timeout,
cancels what is left, then exits 0. A second signal exits at once."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from lineside.errors import LinesideError
from lineside.server.http_limits import HttpLimits, uvicorn_config
from lineside.server.state import ServerState

log = logging.getLogger("lineside.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains instead of closing the socket straight away."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.drain_started = False
        state.on_load_error = self._load_failed

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started or self._loop is None:
            self.should_exit = True
            self.force_exit = self.drain_started
            return
        self.drain_started = True
        log.info("received %s: draining (up to %.1fs)", signal.Signals(sig).name, self.state.drain_timeout)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True

    def _load_failed(self, msg: str) -> None:
        self.should_exit = True


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


def bind_socket(host: str, port: int) -> socket.socket:
    """Resolve, bind and listen before any work (the model is not loaded yet), so a busy port, a privileged
    port or a host that is not this machine's is one line (LinesideError), not uvicorn's log and exit 3."""
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


def run(app: Any, sock: socket.socket, *, log_level: str = "info", access_log: bool = False,
        limits: HttpLimits | None = None) -> None:
    """Serve on a socket from bind_socket until drained or stopped; a model that fails to load raises
    LinesideError (one line)."""
    state: ServerState = app.state.lineside
    host, port = sock.getsockname()[:2]
    config = uvicorn_config(app, host=host, port=port, limits=limits or HttpLimits(), log_level=log_level,
                            access_log=access_log)
    server = DrainingServer(config, state)
    shown = f"[{host}]" if ":" in host else host
    log.info("serving on http://%s:%d (Ctrl-C or SIGTERM drains, then stops)", shown, port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if state.load_error:
        raise LinesideError(state.load_error)
    if not server.started:
        raise LinesideError(f"the server on {shown}:{port} did not start (see the log above)")
