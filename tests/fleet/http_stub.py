"""A node stand-in: a threaded HTTP server on loopback whose GET answers come from a function of the path and
headers (what a lineside node, vLLM or a broken node would say)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = tuple[int, str, bytes]  # status, content-type, body


@contextmanager
def answering(reply: Callable[[str, Any], Reply]) -> Iterator[str]:
    """Serve ``reply(path, headers)`` for every GET; yields the base URL."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            code, ctype, data = reply(self.path, self.headers)
            self.send_response(code)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
