"""Does one huge prompt stall the server? Serves BUNDLE with `lineside serve`, then, while a client posts a
prompt of --mb megabytes to /v1/chat/completions, polls /health every 20 ms and times a short chat; prints
the refusal's time and status, the worst /health latency, the short chat's latency against a baseline
taken just before (same connection pool, same run), and the server's RSS before and after.

    PYTHONPATH=. python benchmarks/hostile_prompt.py BUNDLE [--mb 30 | --chars N] [--tokenizer-processes 1 0]

``--chars N`` sends N characters of varied text instead (e.g. just under the server's text bound, so it is
tokenized); several ``--tokenizer-processes`` values are run one after another in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from lineside.bench.inprocess import free_port, wait_ready


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


_HOSTILE = """
import sys, time, httpx
body = sys.stdin.read().encode()
t = time.perf_counter()
r = httpx.post(sys.argv[1] + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
               timeout=300)
print(r.status_code, (r.json().get("error") or {}).get("code"), time.perf_counter() - t)
"""


def short_chat(c: httpx.Client, url: str) -> float:
    t = time.perf_counter()
    r = c.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--mb", type=float, default=30.0)
    ap.add_argument("--chars", type=int, help="send this many characters of varied text instead of --mb")
    ap.add_argument("--tokenizer-processes", type=int, nargs="+", default=[1])
    args = ap.parse_args()
    for processes in args.tokenizer_processes:
        print(f"--tokenizer-processes {processes}")
        run_once(args, processes)


def hostile_text(args: argparse.Namespace) -> str:
    if args.chars is None:
        return "word " * int(args.mb * (1 << 20) / 5)
    words = "the quick brown fox jumps over a lazy dog; sensor 42 reads 3.14 bar, torque ok".split()
    out, n = [], 0
    i = 0
    while n < args.chars:
        w = words[i % len(words)] + str(i % 97)
        out.append(w)
        n += len(w) + 1
        i += 1
    return " ".join(out)[: args.chars]


def run_once(args: argparse.Namespace, processes: int) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(args.bundle), "--port", str(port),
                             "--threads", "1", "--log-level", "warning", "--tokenizer-processes", str(processes)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_ready(url, 120, alive=lambda: proc.poll() is None)
        with httpx.Client(timeout=120) as c:
            for _ in range(3):
                short_chat(c, url)
            baseline = min(short_chat(c, url) for _ in range(5))
            rss_before = rss_mb(proc.pid)
            text = hostile_text(args)
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
            # the hostile client is another process: building and sending its body must not stall our probes
            hostile = subprocess.Popen([sys.executable, "-c", _HOSTILE, url], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
            hostile.stdin.write(json.dumps(body))
            hostile.stdin.close()
            health: list[float] = []
            chats: list[float] = []
            stop = threading.Event()

            def poll_health() -> None:
                with httpx.Client(timeout=120) as probe:
                    while not stop.is_set():
                        t = time.perf_counter()
                        probe.get(url + "/health")
                        health.append(time.perf_counter() - t)
                        time.sleep(0.02)

            def chat_loop() -> None:
                with httpx.Client(timeout=120) as cc:
                    while not stop.is_set():
                        chats.append(short_chat(cc, url))

            threads = [threading.Thread(target=poll_health), threading.Thread(target=chat_loop)]
            for t in threads:
                t.start()
            status, code, seconds = hostile.stdout.read().split()
            hostile.wait()
            stop.set()
            for t in threads:
                t.join()
            result = {"status": status, "code": code, "seconds": float(seconds)}
            worst_health = max(health or [0.0])
            time.sleep(1.0)
            rss_after = rss_mb(proc.pid)
        print(f"prompt of {len(text)} characters: {result['status']} {result['code']} in {result['seconds']:.2f} s")
        print(f"/health worst latency during it: {worst_health * 1000:.0f} ms")
        print(f"/health: {len(health)} probes while it ran")
        print(f"short chat: baseline {baseline * 1000:.0f} ms, {len(chats)} during it, worst {max(chats or [0]) * 1000:.0f}"
              f" ms (delay {(max(chats or [0]) - baseline) * 1000:.0f} ms)")
        print(f"server RSS: {rss_before:.0f} MB before, {rss_after:.0f} MB after ({rss_after - rss_before:+.0f} MB)")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
