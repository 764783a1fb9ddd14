"""The benchmarks' streaming clients: a lean one (N streaming completions read by one thread) and the stdlib one.

On a 2-core machine the client shares the cores with the server it measures, and every CPU cycle it spends
per token is taken from the server's compute threads (an onnxruntime kernel split over 2 threads waits for the
slower one, so a preempted thread costs about twice its stolen time). In the field the clients run on other
machines. So the benchmark's client should be as cheap as it can be: one thread and a ``selectors`` loop over all
the sockets, llhttp (``httptools``, uvicorn's parser) for the HTTP/1.1 framing and chunked encoding, and one
``json.loads`` per SSE event. The stdlib client (a thread per stream, ``http.client``, ``--client stdlib`` in
served_side_by_side.py) cost 0.17 ms of CPU per token at one stream and its threads contend for the GIL at eight.
Both send the same request and read the same events into a ``Stream``.

    python benchmarks/stream_clients.py --url http://127.0.0.1:8000 [--streams 8] [--client lean|stdlib]

streams completions from a running server at once and prints tokens/s and the client's own CPU per token.
"""

from __future__ import annotations

import http.client
import json
import selectors
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools


@dataclass
class Stream:
    """One streaming completion as the client saw it."""

    text: str = ""
    chunks: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    end_s: float = 0.0  # since the request was sent
    finish_reason: str | None = None
    tokens: int = 0

    def decode_tps(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.decode_s > 0 and self.tokens > 1 else float("nan")


@dataclass
class _Events:
    """One stream's SSE events as they arrive: the text, chunk times and usage they carry."""

    max_tokens: int
    t0: float
    stream: Stream = field(default_factory=Stream)
    status: int = 0
    first: float | None = None
    last: float = 0.0
    done: bool = False
    error: bytes = b""

    def event(self, event: bytes, now: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            ev = json.loads(data)
            s = self.stream
            for ch in ev.get("choices", []):
                text = ch.get("text") or ""
                if text:
                    self.first = self.first or now
                    self.last = now
                    s.text += text
                    s.chunks += 1
                s.finish_reason = ch.get("finish_reason") or s.finish_reason
            if ev.get("usage"):
                s.tokens = int(ev["usage"].get("completion_tokens") or 0)

    def finish(self, url: str) -> Stream:
        s = self.stream
        s.end_s = time.perf_counter() - self.t0
        if self.status != 200:
            raise RuntimeError(f"{url} answered {self.status}: {self.error[:300]!r}")
        if self.first is None:
            raise RuntimeError(f"{url} streamed no text")
        s.ttft_s, s.decode_s = self.first - self.t0, self.last - self.first
        if not s.tokens:  # no usage event: a stream stopped by length has exactly max_tokens tokens
            s.tokens = self.max_tokens if s.finish_reason == "length" else s.chunks
        return s


class _Conn(_Events):
    """A request in flight on its own socket, framed by llhttp; its body is split into SSE events."""

    def __init__(self, sock: socket.socket, max_tokens: int, t0: float) -> None:
        super().__init__(max_tokens, t0)
        self.sock = sock
        self.pending = b""
        self.parser = httptools.HttpResponseParser(self)

    # llhttp callbacks
    def on_status(self, _status: bytes) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error += body
            return
        self.pending += body
        if b"\n\n" not in self.pending:
            return
        *events, self.pending = self.pending.split(b"\n\n")
        now = time.perf_counter()
        for event in events:
            self.event(event, now)

    def on_message_complete(self) -> None:
        self.done = True


def _body(model: str, prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()


def _request(host: str, model: str, prompt: str, max_tokens: int) -> bytes:
    body = _body(model, prompt, max_tokens)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def _read_all(conns: list[_Conn], url: str, deadline: float) -> None:
    """Feed each socket's bytes to its parser as they come, until every stream has ended."""
    sel = selectors.DefaultSelector()
    for conn in conns:
        sel.register(conn.sock, selectors.EVENT_READ, conn)
    open_ = len(conns)
    try:
        while open_:
            ready = sel.select(timeout=max(0.0, deadline - time.perf_counter()))
            if not ready:
                raise TimeoutError(f"{url}: {open_} of {len(conns)} streams still open at the deadline")
            for key, _ in ready:
                conn = key.data
                data = conn.sock.recv(1 << 16)
                if data:
                    conn.parser.feed_data(data)
                if conn.done or not data:
                    sel.unregister(conn.sock)
                    open_ -= 1
    finally:
        sel.close()


def _read_alone(conn: _Conn, url: str, timeout: float) -> None:
    """One stream: a blocking recv per read (a timeout set on a Python socket polls before every recv: two
    system calls a token, which on this VM cost the client as much as the rest of its work)."""
    conn.sock.settimeout(None)
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(timeout), 0))
    while not conn.done:
        try:
            data = conn.sock.recv(1 << 16)
        except BlockingIOError:
            raise TimeoutError(f"{url}: no bytes for {timeout:.0f} s") from None
        if not data:
            return
        conn.parser.feed_data(data)


def stream_many(url: str, model: str, prompts: list[str], max_tokens: int,
                timeout: float = 600.0) -> tuple[float, list[Stream]]:
    """Send every prompt at once as a streaming greedy /v1/completions; (wall seconds until the last stream
    ended, the streams in prompt order)."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    conns: list[_Conn] = []
    t0 = time.perf_counter()
    try:
        for prompt in prompts:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
            conns.append(conn := _Conn(sock, max_tokens, time.perf_counter()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_request(host, model, prompt, max_tokens))
        if len(conns) == 1:
            _read_alone(conns[0], url, timeout)
        else:
            _read_all(conns, url, t0 + timeout)
    finally:
        for conn in conns:
            conn.sock.close()
    wall = time.perf_counter() - t0
    return wall, [c.finish(url) for c in conns]


def stream_completion(url: str, model: str, prompt: str, max_tokens: int) -> Stream:
    """One streaming greedy /v1/completions."""
    return stream_many(url, model, [prompt], max_tokens)[1][0]


def stdlib_stream_completion(url: str, model: str, prompt: str, max_tokens: int) -> Stream:
    """The same request read with ``http.client`` line by line (the client these benchmarks used before)."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", _body(model, prompt, max_tokens), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    c = _Events(max_tokens, t0)
    c.status = resp.status
    if resp.status != 200:
        c.error = resp.read()
    while resp.status == 200 and not c.done:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data:"):
            c.event(line.strip(), time.perf_counter())
    conn.close()
    return c.finish(url)


def stdlib_stream_many(url: str, model: str, prompts: list[str], max_tokens: int) -> tuple[float, list[Stream]]:
    """``stream_many`` with a thread and a ``stdlib_stream_completion`` per prompt."""
    out: list[Stream | BaseException | None] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            out[i] = stdlib_stream_completion(url, model, prompts[i], max_tokens)
        except BaseException as e:  # re-raised in the caller's thread
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for s in out:
        if isinstance(s, BaseException):
            raise s
    return wall, [s for s in out if isinstance(s, Stream)]


StreamOne = Callable[[str, str, str, int], Stream]
StreamMany = Callable[[str, str, list[str], int], tuple[float, list[Stream]]]
CLIENTS: dict[str, tuple[StreamOne, StreamMany]] = {
    "lean": (stream_completion, stream_many),
    "stdlib": (stdlib_stream_completion, stdlib_stream_many),
}


def main() -> None:
    import argparse
    import urllib.request

    ap = argparse.ArgumentParser(description="Stream greedy completions from a running OpenAI-compatible server at "
                                             "once and print tokens/s and this client's own CPU per token.")
    ap.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default="", help="default: the first model the server lists")
    ap.add_argument("--prompt", default="Once upon a time, in a small town by the sea, there lived an old clockmaker who")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--client", choices=sorted(CLIENTS), default="lean")
    args = ap.parse_args()
    url = args.url.rstrip("/")
    try:
        model = args.model or json.load(urllib.request.urlopen(url + "/v1/models", timeout=10))["data"][0]["id"]
        cpu0 = time.process_time()
        wall, streams = CLIENTS[args.client][1](url, model, [args.prompt] * args.streams, args.max_tokens)
    except (OSError, RuntimeError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"stream_clients: {url}: {e}") from None
    tokens = sum(s.tokens for s in streams)
    print(f"{args.streams} streams, {tokens} tokens in {wall:.2f} s: {tokens / wall:.1f} tok/s aggregate; decode per "
          f"stream {statistics.median(s.decode_tps() for s in streams):.1f} tok/s (median); client CPU "
          f"{1e3 * (time.process_time() - cpu0) / max(tokens, 1):.3f} ms/token ({args.client})")


if __name__ == "__main__":
    main()
