"""Serve an ASGI app on a free loopback port in a background thread, for `bench --bundle` and the tests.

The bench then drives it through the same HTTP client as a remote server, so in-process numbers
include the HTTP/SSE layer exactly as a real deployment does.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx

from lineside.errors import LinesideError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ready_body(url: str) -> dict:
    """A lineside server's /health/ready answer ({} from a server that gives none)."""
    try:
        r = httpx.get(url + "/health/ready", timeout=5.0)
        body = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def ready_after_s(url: str) -> float | None:
    """What a lineside server says of its own start (process start -> ready, seconds); None if it doesn't."""
    value = _ready_body(url).get("ready_after_s")
    return float(value) if isinstance(value, (int, float)) else None


def server_backend(url: str) -> tuple[str | None, str | None]:
    """The backend a lineside server runs on and why --backend chose it, from /health/ready; (None, None) from a
    server that does not say (another OpenAI-compatible server)."""
    body = _ready_body(url)
    backend, reason = body.get("backend"), body.get("backend_reason")
    return (backend if isinstance(backend, str) else None,
            reason if isinstance(reason, str) and isinstance(backend, str) else None)


def wait_ready(url: str, timeout: float, alive=lambda: True, ready_path: str = "/health/ready") -> None:
    """Poll ``url + ready_path`` until it answers 200; LinesideError if ``alive()`` turns false or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise LinesideError(f"the server at {url} exited before it was ready")
        try:
            if httpx.get(url + ready_path, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise LinesideError(f"the server at {url} was not ready within {timeout:.0f}s ({ready_path} never answered 200)")


class BackgroundServer:
    """uvicorn on 127.0.0.1:<free port> in a daemon thread; a context manager that waits until ready."""

    def __init__(self, app, ready_path: str = "/health/ready", startup_timeout: float = 120.0,
                 make_config=None) -> None:
        """``make_config(app, host, port)`` builds the uvicorn.Config (a server's own protocol and limits);
        default: uvicorn's."""
        import uvicorn

        self.host = "127.0.0.1"
        self.port = free_port(self.host)
        self.ready_path = ready_path
        self.startup_timeout = startup_timeout
        config = (make_config(app, self.host, self.port) if make_config is not None else
                  uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", lifespan="on",
                                 access_log=False))
        self._server = uvicorn.Server(config)
        self._state = getattr(getattr(app, "state", None), "lineside", None)  # lineside's own app: its load error
        self._thread = threading.Thread(target=self._server.run, name="lineside-bench-server", daemon=True)
        self.start_to_ready_s: float | None = None  # start() -> /health/ready answered 200

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        started = time.monotonic()
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise LinesideError("the in-process server stopped during startup; run `lineside serve BUNDLE` "
                                   "to see why")
            load_error = getattr(self._state, "load_error", None)
            if load_error:  # the model will never load (a damaged bundle): say why now, not at the timeout
                self.stop()
                raise LinesideError(load_error)
            if self._server.started:
                try:
                    if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                        self.start_to_ready_s = time.monotonic() - started
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise LinesideError(f"the in-process server was not ready within {self.startup_timeout:.0f}s "
                           f"({self.ready_path} never answered 200)")

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def bundle_app(bundle: Path, **options):
    """lineside's own server app for a bundle (imported lazily: bench must work without the server part);
    options that are not None (threads, num_slots, ...) go to create_app."""
    if not Path(bundle).is_dir():
        raise LinesideError(f"bundle {bundle} is not a directory; pass the output of `lineside build`")
    try:
        from lineside.server.app import create_app
    except ImportError as e:
        raise LinesideError(f"--bundle needs lineside.server.app.create_app, which this install lacks ({e}); "
                           "start a server and use --url instead") from None
    return create_app(str(bundle), **{k: v for k, v in options.items() if v is not None})
