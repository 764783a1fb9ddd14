"""What the fleet gateway adds: TTFT and decode tokens/s direct to a `lineside serve` worker, through its SMG
router alone, and through the whole gateway (front + SMG), interleaved request by request.

    python benchmarks/gateway_overhead.py BUNDLE [--n 100] [--decode-n 20] [--decode-tokens 64] [--session ID]
        [--peer CHECKOUT]

One worker (`lineside serve BUNDLE`), one pool, no shadow: `lineside fleet gateway` runs as a subprocess like a
deployment. Each round sends the same streaming /v1/chat/completions request to the three paths in turn, so
drift hits all alike. TTFT: one token, time to the first token event. Decode: tokens after the first over the
time from the first to the last token event. Also the front's CPU time per request (the gateway process's
user+system time over the run / its requests; SMG runs in child processes): unlike wall time it hardly moves
with other load on the machine. Timing only: no pass/fail. Goal (issue 19): median added TTFT ≤ 2 ms and no
loss in decode tokens/s. ``--peer CHECKOUT`` runs a second whole gateway from another checkout (its own SMG
router, the same worker) and interleaves it too: two fronts compared in one run, each with its CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from lineside.bench.inprocess import free_port, wait_ready
from lineside.errors import LinesideError


def start(argv: list[str], url: str, ready: str, log: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    """``cwd`` matters with ``-m``: Python puts the working directory before PYTHONPATH on sys.path."""
    with open(log, "ab") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                             env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                  **(env or {})})
    try:
        wait_ready(url, 300, alive=lambda: p.poll() is None, ready_path=ready)
    except LinesideError as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        sys.exit(f"{e} (see {log})")
    return p


class ConnectionClosedIdle(Exception):
    """The server closed the kept-alive connection before this request was answered."""


class Stream:
    """A keep-alive HTTP/1.1 connection that times one streaming request's token events (no client library
    in the measurement)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def run(self, body: dict, session: str | None = None) -> tuple[float, float | None, int]:
        """(TTFT s, decode tokens/s or None, token events) for one request; once more on a new connection when
        the server had closed the kept-alive one (uvicorn closes it after 5 s idle, which the interleaved decode
        rounds of a slow model exceed), the timing restarted."""
        try:
            return await self._run(body, session)
        except ConnectionClosedIdle:
            self.writer.close()
            await self.connect()
            return await self._run(body, session)

    async def _run(self, body: dict, session: str | None = None) -> tuple[float, float | None, int]:
        data = json.dumps(body).encode()
        extra = f"X-Session-Id: {session}\r\n" if session else ""
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{extra}"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        t0 = time.perf_counter()
        self.writer.write(head + data)
        status = await self.reader.readline()
        if not status:
            raise ConnectionClosedIdle
        if b" 200 " not in status:
            raise RuntimeError(f"answered {status!r}")
        chunked = False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            chunked |= line.lower().startswith(b"transfer-encoding: chunked")
        if not chunked:
            raise RuntimeError("expected a chunked SSE body")
        times, buf = [], b""
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            buf += chunk[:-2]
            while b"\n\n" in buf:  # one SSE event per blank line, however the proxies cut the chunks
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: {") and b'"content"' in event and b'"role"' not in event:
                    times.append(time.perf_counter())
        if not times:
            raise RuntimeError("no token event")
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 and times[-1] > times[0] else None
        return times[0] - t0, rate, len(times)


def free_pair() -> int:
    """A port whose next port is free too (an SMG router and its metrics)."""
    for _ in range(100):
        base = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
                return base
            except OSError:
                continue
    sys.exit("no two consecutive free ports on 127.0.0.1")


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_on(path: str, c: Stream, body: dict, session: str | None) -> tuple[float, float | None, int]:
    try:
        return await c.run(body, session)
    except (RuntimeError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        raise SystemExit(f"{path}: {e!r}") from None


async def measure(paths: dict[str, str], args: argparse.Namespace) -> int:
    """Prints the table; returns how many requests each path got."""
    conns = {}
    for name, url in paths.items():
        conns[name] = Stream(url)
        await conns[name].connect()
    ttft_body = {"model": "bench", "messages": [{"role": "user", "content": args.prompt}], "max_tokens": 1,
                 "temperature": 0, "stream": True}
    dec_body = {**ttft_body, "max_tokens": args.decode_tokens, "ignore_eos": True}
    for _ in range(args.warmup):
        for c in conns.values():
            await c.run(ttft_body)
    ttft: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(args.n):
        for k, c in conns.items():
            ttft[k].append((await run_on(k, c, ttft_body, args.session))[0])
    rate: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(args.decode_n):
        for k, c in conns.items():
            r = (await run_on(k, c, dec_body, args.session))[1]
            if r:
                rate[k].append(r)
    base = med(ttft["direct"])
    print(f"TTFT, 1 token, streaming chat, n={args.n} each, interleaved (prompt {args.prompt!r})")
    for k in paths:
        q = statistics.quantiles(ttft[k], n=10)
        added = "" if k == "direct" else f"   added {1e3 * (med(ttft[k]) - base):+6.2f} ms"
        paired = "" if k == "direct" else (
            f" (median paired {1e3 * med([a - b for a, b in zip(ttft[k], ttft['direct'], strict=True)]):+6.2f})")
        print(f"  {k:<14} median {1e3 * med(ttft[k]):7.2f} ms  p10 {1e3 * q[0]:7.2f}  p90 {1e3 * q[-1]:7.2f}"
              f"{added}{paired}")
    print(f"decode, {args.decode_tokens} tokens, n={args.decode_n} each")
    rbase = med(rate["direct"]) if rate["direct"] else float("nan")
    for k in paths:
        if rate[k]:
            print(f"  {k:<14} median {med(rate[k]):8.1f} tok/s   vs direct {100 * (med(rate[k]) / rbase - 1):+5.1f}%")
    for c in conns.values():
        c.writer.close()
    return args.warmup + args.n + args.decode_n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--n", type=int, default=100, help="TTFT requests per path")
    ap.add_argument("--decode-n", type=int, default=20, help="decode requests per path")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--session", default=None, help="send this X-Session-Id on every path (SMG's sticky map)")
    ap.add_argument("--peer", type=Path, default=None,
                    help="a second checkout whose gateway is measured too (PYTHONPATH=CHECKOUT), interleaved")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lineside-gw-bench-"))
    wport, gport = free_port(), free_port()
    sbase = free_pair()
    procs = []
    try:
        procs.append(start([sys.executable, "-m", "lineside", "serve", str(args.bundle), "--port", str(wport),
                            "--threads", str(args.threads), "--num-slots", "4", "--log-level", "warning",
                            "--served-model-name", "bench"], f"http://127.0.0.1:{wport}", "/health/ready",
                           tmp / "worker.log"))
        gateways = {"gateway": (gport, sbase, None)}
        if args.peer is not None:  # run from the peer checkout too: `-m` looks in the working directory first
            gateways["gateway (peer)"] = (free_port(), free_pair(), {"PYTHONPATH": str(args.peer.resolve())})
        fronts = {}
        for name, (port, smg_base, env) in gateways.items():
            fleet = {"nodes": [{"name": "w", "kind": "x86", "url": f"http://127.0.0.1:{wport}"}],
                     "pools": {"realtime": {"members": ["w"], "policy": "round_robin"}},
                     "gateway": {"port": port, "smg_base_port": smg_base}}
            d = tmp / name.replace(" ", "_").strip("()")
            d.mkdir()
            (d / "fleet.yaml").write_text(yaml.safe_dump(fleet, sort_keys=False))
            procs.append(start([sys.executable, "-m", "lineside", "fleet", "gateway", str(d / "fleet.yaml"), "-o",
                                str(d / "gw")], f"http://127.0.0.1:{port}", "/fleet/health", d / "gateway.log", env,
                               cwd=args.peer.resolve() if env else None))
            fronts[name] = procs[-1]
        paths = {"direct": f"http://127.0.0.1:{wport}", "smg router": f"http://127.0.0.1:{sbase}",
                 **{name: f"http://127.0.0.1:{port}" for name, (port, _, _) in gateways.items()}}
        cpu0 = {name: cpu_s(p.pid) for name, p in fronts.items()}
        per_path = asyncio.run(measure(paths, args))
        for name, p in fronts.items():
            print(f"front CPU per request, {name}: {1e6 * (cpu_s(p.pid) - cpu0[name]) / per_path:.0f} us "
                  f"({per_path} requests)")
        print(f"load average {os.getloadavg()[0]:.1f}" + (f"; peer = {args.peer}" if args.peer else ""))
        for name, p in fronts.items():  # which checkout each front ran (its lineside is imported from there)
            print(f"  {name}: run in {os.readlink(f'/proc/{p.pid}/cwd')}")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
