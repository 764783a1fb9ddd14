"""Does one huge prompt stall the server? Serves BUNDLE with `lineside serve`, then, while a client posts a
prompt of --mb megabytes to /v1/chat/completions, polls /health every 20 ms and times a short chat; prints
the refusal's time and status, the worst /health latency, the short chat's latency against a baseline
taken just before (same connection pool, same run), and the server's RSS before and after.

    PYTHONPATH=. python benchmarks/hostile_prompt.py BUNDLE [--mb 30]
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(args.bundle), "--port", str(port),
                             "--threads", "1", "--log-level", "warning"], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_ready(url, 120, alive=lambda: proc.poll() is None)
        with httpx.Client(timeout=120) as c:
            for _ in range(3):
                short_chat(c, url)
            baseline = min(short_chat(c, url) for _ in range(5))
            rss_before = rss_mb(proc.pid)
            text = "word " * int(args.mb * (1 << 20) / 5)
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
            result: dict = {}

            def hostile() -> None:
                with httpx.Client(timeout=300) as h:
                    t = time.perf_counter()
                    r = h.post(url + "/v1/chat/completions", json=body)
                    result.update(status=r.status_code, seconds=time.perf_counter() - t,
                                  code=(r.json().get("error") or {}).get("code"))

            worst_health = 0.0
            chats: list[float] = []
            th = threading.Thread(target=hostile)
            th.start()
            with httpx.Client(timeout=120) as probe:
                while th.is_alive():
                    t = time.perf_counter()
                    probe.get(url + "/health")
                    worst_health = max(worst_health, time.perf_counter() - t)
                    if len(chats) < 3:
                        chats.append(short_chat(c, url))
                    time.sleep(0.02)
            th.join()
            time.sleep(1.0)
            rss_after = rss_mb(proc.pid)
        print(f"prompt {args.mb:.0f} MB: {result['status']} {result['code']} in {result['seconds']:.2f} s")
        print(f"/health worst latency during it: {worst_health * 1000:.0f} ms")
        print(f"short chat: baseline {baseline * 1000:.0f} ms, during it worst {max(chats or [0]) * 1000:.0f} ms "
              f"(delay {(max(chats or [0]) - baseline) * 1000:.0f} ms)")
        print(f"server RSS: {rss_before:.0f} MB before, {rss_after:.0f} MB after ({rss_after - rss_before:+.0f} MB)")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
