"""Run the app under uvicorn with a graceful drain: on SIGTERM (or Ctrl-C) the server keeps listening but
answers 503 to new generation requests, lets in-flight ones finish for up to the drain timeout,
cancels what is left, then exits 0. A second signal ends the drain at once: what is in flight is cancelled
(each answer ends with an error event, as at the drain timeout) and the server exits 0 within ~2 s; a third
(or those 2 s passing) stops it where it is. An engine that failed (runtime/engine_health.py) stops the server too,
which then exits 1: a supervisor restarts it."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from lineside.errors import LinesideError
from lineside.server.bind import bind_error_line, bind_socket, url_of
from lineside.server.http_limits import HttpLimits, uvicorn_config
from lineside.server.state import ServerState

__all__ = ["DrainingServer", "bind_error_line", "bind_socket", "run"]

log = logging.getLogger("lineside.server")
HURRY_S = 2.0  # after a second signal: how long the cancelled requests get to end before the exit is forced


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains instead of closing the socket straight away."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.drain_started = False
        self.hurried = False
        state.on_load_error = self._load_failed
        state.on_engine_failure = self._engine_failed

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:
            self.should_exit = True
            return
        if self.drain_started and not self.hurried:
            # uvicorn's own forced exit drops the running responses mid-write (a stream cut with no error event)
            # and logs a CancelledError traceback for each: cancel them through the engine instead, then exit
            self.hurried = True
            log.info("received %s again: cancelling what is in flight and stopping", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._hurry)
            return
        if self.drain_started:
            self.should_exit = self.force_exit = True
            return
        self.drain_started = True
        log.info("received %s: draining (up to %.1fs)", signal.Signals(sig).name, self.state.drain_timeout)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _hurry(self) -> None:
        self.state.hurry()
        assert self._loop is not None
        self._loop.call_later(HURRY_S, self._force)

    def _force(self) -> None:
        self.should_exit = self.force_exit = True

    def _begin_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True

    def _load_failed(self, msg: str) -> None:
        self.should_exit = True

    def _engine_failed(self, msg: str) -> None:
        """The engine failed (runtime/engine_health.py): as vLLM does when its engine dies, stop serving and exit
        non-zero, so a supervisor (systemd's Restart=on-failure, Kubernetes, Docker's restart policy) starts a
        fresh process; its requests have all ended already (503 / 500), and /health answers 503 until the end."""
        self.should_exit = True


def run(app: Any, sock: socket.socket, *, log_level: str = "info", access_log: bool = False,
        limits: HttpLimits | None = None) -> None:
    """Serve on a socket from bind_socket until drained or stopped; a model that fails to load raises
    LinesideError (one line)."""
    state: ServerState = app.state.lineside
    host, port = sock.getsockname()[:2]
    config = uvicorn_config(app, host=host, port=port, limits=limits or HttpLimits(), log_level=log_level,
                            access_log=access_log)
    server = DrainingServer(config, state)
    url = url_of(sock.getsockname())
    log.info("serving on %s (Ctrl-C or SIGTERM drains, then stops)", url)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if state.load_error:
        raise LinesideError(state.load_error)
    if state.engine_failure is not None:
        raise LinesideError(f"the model engine failed: {state.engine_failure}; exiting 1 so a supervisor restarts "
                            "the server (see the log above for the traceback)")
    if not server.started:
        raise LinesideError(f"the server on {url} did not start (see the log above)")
