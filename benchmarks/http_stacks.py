"""Which ASGI server stack refuses smuggling, bad chunks, oversized headers and slow clients on its own?

Starts each candidate (uvicorn with h11 / httptools / zttp, hypercorn, granian) on loopback as a
subprocess serving the tiny app below, with a 2 s keep-alive / read timeout where the stack has one,
then sends raw-socket probes at once and prints, per probe: the first status line, whether a second
(smuggled) response came back, and how long until the server closed the connection (— = still open
after the window). `lineside serve`'s own guard (lineside/server/http_limits.py) is the last row.

    PYTHONPATH=. python benchmarks/http_stacks.py [--window 6]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from lineside.bench.inprocess import free_port


async def app(scope, receive, send):  # noqa: ANN001 - a bare ASGI app
    """Reads the whole body, answers 200 with the path: a second status line means a second request ran."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
        if message["type"] == "http.disconnect":
            return
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


_HEAD = b"POST /a HTTP/1.1\r\nHost: 127.0.0.1\r\n"
PROBES: dict[str, list[bytes | float]] = {
    "CL+TE, then a smuggled GET": [_HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                                   b"GET /smuggled HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"],
    "chunk size of 20 hex F": [_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"F" * 20 + b"\r\nabc"],
    "chunk size 'zz'": [_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"],
    "one 64 KiB header": [_HEAD + b"X-Big: " + b"a" * 65536 + b"\r\nContent-Length: 0\r\n\r\n"],
    "500 headers": [_HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"Content-Length: 0\r\n\r\n"],
    "headers never finished": [_HEAD],
    "headers 1 byte/s": [b"P", 1.0, b"O", 1.0, b"S", 1.0, b"T", 1.0, b" ", 1.0, b"/", 1.0, b"a", 1.0, b" "],
    "body stalls at 10 of 100": [_HEAD + b"Content-Length: 100\r\n\r\n" + b"x" * 10],
    "idle keep-alive": [_HEAD + b"Content-Length: 0\r\n\r\n"],
}


@dataclass
class Outcome:
    status: str
    responses: int
    closed_after: float | None


def probe(port: int, steps: list[bytes | float], window: float) -> Outcome:
    s = socket.create_connection(("127.0.0.1", port), timeout=window)
    s.settimeout(0.1)
    t0 = time.monotonic()
    got = bytearray()
    closed: list[float] = []

    def read_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while not closed and time.monotonic() < end:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                closed.append(time.monotonic() - t0)
            got.extend(chunk)

    try:
        for step in steps:
            if closed:
                break
            if isinstance(step, float):
                read_for(step)
                continue
            try:
                s.sendall(step)
            except OSError:  # the server closed while we were still sending
                read_for(0.2)
                closed.append(time.monotonic() - t0)
        read_for(window - (time.monotonic() - t0))
    finally:
        s.close()
    lines = [ln for ln in bytes(got).split(b"\r\n") if ln.startswith(b"HTTP/1.")]
    return Outcome(lines[0].decode(errors="replace")[9:] if lines else "-", len(lines),
                   closed[0] if closed else None)


def commands(port: int) -> dict[str, list[str]]:
    py = sys.executable
    uv = [py, "-m", "uvicorn", "benchmarks.http_stacks:app", "--port", str(port), "--log-level", "critical",
          "--timeout-keep-alive", "2", "--http"]
    return {
        "uvicorn+h11": [*uv, "h11"],
        "uvicorn+httptools": [*uv, "httptools"],
        "uvicorn+zttp": [*uv, "zttp"],
        "hypercorn": [py, "-m", "hypercorn", "benchmarks.http_stacks:app", "--bind", f"127.0.0.1:{port}",
                      "--keep-alive", "2", "--read-timeout", "2", "--log-level", "critical"],
        "granian": [py, "-m", "granian", "--interface", "asgi", "benchmarks.http_stacks:app", "--host", "127.0.0.1",
                    "--port", str(port), "--http", "1", "--workers", "1", "--http1-header-read-timeout", "2000",
                    "--log-level", "critical"],
        "lineside guard": [py, "-m", "benchmarks.http_stacks", "--serve-guarded", str(port)],
    }


def serve_guarded(port: int) -> None:
    """The tiny app under the protocol `lineside serve` uses, with 2 s timeouts."""
    import uvicorn

    from lineside.server.http_limits import HttpLimits, uvicorn_config

    limits = HttpLimits(header_timeout=2.0, body_timeout=2.0, keep_alive_timeout=2.0)
    uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, limits=limits, log_level="critical")).run()


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=6.0, help="seconds to watch each probe's connection")
    ap.add_argument("--serve-guarded", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_guarded:
        serve_guarded(args.serve_guarded)
        return
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    rows = []
    for name in commands(0):
        port = free_port()
        proc = subprocess.Popen(commands(port)[name], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if not _wait_listening(port, proc):
                rows.append((name, {p: None for p in PROBES}))
                continue
            with concurrent.futures.ThreadPoolExecutor(len(PROBES)) as pool:
                futures = {p: pool.submit(probe, port, steps, args.window) for p, steps in PROBES.items()}
                rows.append((name, {p: f.result() for p, f in futures.items()}))
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"window {args.window:.0f} s; cell: first status / responses / closed after s (— still open)\n")
    print("| probe | " + " | ".join(n for n, _ in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for p in PROBES:
        cells = []
        for _, res in rows:
            o = res[p]
            cells.append("no server" if o is None else
                         f"{o.status} / {o.responses} / {'—' if o.closed_after is None else f'{o.closed_after:.1f}'}")
        print(f"| {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
