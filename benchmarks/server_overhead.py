"""The HTTP shim's own overhead: TTFT through `lineside serve` (streaming /v1/completions and /v1/chat/completions
over loopback) minus TTFT of the same engine called in-process, for a short prompt and one token.

    python benchmarks/server_overhead.py BUNDLE [--n 200] [--prompt "Hello"] [--threads 1]

The server runs as a `lineside serve` subprocess (a real deployment: no GIL shared with the client); the
in-process engine (same bundle, slots, threads) lives in this process. Requests alternate HTTP / in-process
so drift hits both alike; the engine is idle for every request. Timing only: no pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
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

import httpx

from lineside.bench.inprocess import free_port, wait_ready
from lineside.errors import LinesideError


def start_server(bundle: Path, threads: int, slots: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(bundle), "--host", "127.0.0.1", "--port",
                             str(port), "--threads", str(threads), "--num-slots", str(slots), "--log-level", "warning",
                             "--latency-log", str(log)],
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 300, alive=lambda: proc.poll() is None)
    except LinesideError as e:
        proc.kill()
        sys.exit(str(e))
    return proc, url


class RawClient:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams, so the number is the server's cost and
    not a client library's (httpx alone adds about a millisecond per request here)."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request_bytes(self, path: str, body: dict, request_id: str) -> bytes:
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"X-Request-Id: {request_id}\r\nContent-Length: {len(data)}\r\n\r\n")
        return head.encode() + data

    async def first_token(self, raw: bytes) -> float:
        """Send one streaming request; seconds until the first SSE event with a token; reads the rest."""
        assert self.reader is not None and self.writer is not None
        t0 = time.perf_counter()
        self.writer.write(raw)
        status = await self.reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"server answered {status!r}")
        while (await self.reader.readline()) not in (b"\r\n", b""):
            pass
        first = None
        while True:  # chunked body: size line, data, CRLF; 0 ends it
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            if first is None and chunk.startswith(b"data: {") and b'"role"' not in chunk:
                first = time.perf_counter()
        assert first is not None, "no token event"
        return first - t0

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def http_body(prompt: str, chat: bool) -> tuple[str, dict]:
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=1, temperature=0, stream=True)
    return path, body


async def engine_ttft(engine, prompt: str, chat: bool) -> float:
    """Seconds from tokenizing + submitting to the first event with a token, same engine API the server uses."""
    from lineside.runtime.request import GenerationRequest

    t0 = time.perf_counter()
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    handle = engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=1))
    first = None
    async for ev in handle:
        if first is None and ev.completion_tokens > 0:
            first = time.perf_counter()
    return first - t0


def summary(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=10)
    return f"median {statistics.median(xs) * 1e3:7.2f} ms   p10 {q[0] * 1e3:7.2f}   p90 {q[-1] * 1e3:7.2f}"


async def main_async(args: argparse.Namespace) -> None:
    from lineside.runtime.engine import LLMEngine

    tmp = tempfile.TemporaryDirectory()
    log = Path(tmp.name) / "latency.jsonl"
    proc, url = start_server(args.bundle, args.threads, args.slots, log)
    engine = LLMEngine(args.bundle, backend="onnxruntime", num_slots=args.slots, threads=args.threads)
    await engine.start()
    try:
        client = RawClient(url)
        await client.connect()
        for chat in (False, True):
            name = "chat" if chat else "completions"
            path, body = http_body(args.prompt, chat)
            for i in range(args.warmup):
                await client.first_token(client.request_bytes(path, body, f"warm-{name}-{i}"))
                await engine_ttft(engine, args.prompt, chat)
            h, e, ids = [], [], []
            for i in range(args.n):
                ids.append(f"{name}-{i}")
                h.append(await client.first_token(client.request_bytes(path, body, ids[-1])))
                e.append(await engine_ttft(engine, args.prompt, chat))
            await asyncio.sleep(0.2)  # the server writes the log line after the last chunk
            logged = {d["request_id"]: d for d in map(json.loads, log.read_text().splitlines())}
            same = [a - logged[k]["engine_ttft_s"] for a, k in zip(h, ids, strict=True) if k in logged]
            diff = [a - b for a, b in zip(h, e, strict=True)]
            print(f"{name} (n={args.n}, prompt {args.prompt!r}, 1 token, streaming)")
            print(f"  TTFT through HTTP   {summary(h)}")
            print(f"  TTFT in-process     {summary(e)}")
            print(f"  shim overhead       median(HTTP) - median(in-process) = "
                  f"{(statistics.median(h) - statistics.median(e)) * 1e3:.2f} ms; "
                  f"median of paired differences = {statistics.median(diff) * 1e3:.2f} ms")
            print(f"  same request        HTTP TTFT - the server engine's own TTFT (latency log): {summary(same)}")
        await client.close()
        async with httpx.AsyncClient(timeout=60) as hc:  # what a Python app using httpx sees, for context
            path, body = http_body(args.prompt, False)
            xs = []
            for i in range(args.warmup + args.n):
                t0 = time.perf_counter()
                async with hc.stream("POST", url + path, json=body) as r:
                    first = None
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter()
                if i >= args.warmup:
                    xs.append(first - t0)
            print(f"completions through the httpx client (client library included)\n  TTFT {summary(xs)}")
    finally:
        await engine.stop(0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--n", type=int, default=200, help="measured requests per endpoint and path")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (both sides)")
    ap.add_argument("--slots", type=int, default=8, help="KV slots (both sides)")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
