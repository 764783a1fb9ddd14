"""Does one huge prompt stall the server? Serves BUNDLE with `lineside serve`, then runs --rounds rounds, each a
quiet window and a hostile window in alternating order: in both, a client times short chats back to back and a
probe polls /health every 20 ms; in the hostile one, another process (its body built before the window opens)
posts a prompt of --mb megabytes (or --chars characters) to /v1/chat/completions. Prints the refusal's status
and time, the chats' latency in the quiet windows against the hostile ones (same run, interleaved, same
threads, no priority change here), the worst /health latency, and the server's RSS before and after.

    PYTHONPATH=. python benchmarks/hostile_prompt.py BUNDLE [--mb 30 | --chars N [--text varied|word]]
                 [--tokenizer-processes 1 0] [--rounds 6]

``--chars N`` sends N characters (e.g. just under the server's text bound, so it is tokenized): ``varied`` words
and numbers, or one ``word`` with no space (nothing to cut: tokenized whole). Several ``--tokenizer-processes``
values run one after another in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


# The hostile client: builds its request first, says so, waits for the word, then posts and reports.
_HOSTILE = """
import sys, time, httpx
body = open(sys.argv[2], "rb").read()
client = httpx.Client(timeout=300)
print("ready", flush=True)
sys.stdin.readline()
t = time.perf_counter()
r = client.post(sys.argv[1] + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
print(r.status_code, (r.json().get("error") or {}).get("code"), time.perf_counter() - t, flush=True)
"""


def short_chat(c: httpx.Client, url: str) -> float:
    t = time.perf_counter()
    r = c.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t


def hostile_text(args: argparse.Namespace) -> str:
    if args.chars is None:
        return "word " * int(args.mb * (1 << 20) / 5)
    if args.text == "word":
        return "ab" * (args.chars // 2)
    words = "the quick brown fox jumps over a lazy dog; sensor 42 reads 3.14 bar, torque ok".split()
    out, n, i = [], 0, 0
    while n < args.chars:
        w = words[i % len(words)] + str(i % 97)
        out.append(w)
        n += len(w) + 1
        i += 1
    return " ".join(out)[: args.chars]


class Window:
    """Chats timed back to back and /health polled while a window is open (one client each, same threads)."""

    def __init__(self, url: str):
        self.url = url
        self.chats: list[float] = []
        self.health: list[float] = []
        self.stop = threading.Event()

    def run(self, until: threading.Event, min_chats: int) -> None:
        def health() -> None:
            with httpx.Client(timeout=120) as probe:
                while not self.stop.is_set():
                    t = time.perf_counter()
                    probe.get(self.url + "/health")
                    self.health.append(time.perf_counter() - t)
                    time.sleep(0.02)

        probe = threading.Thread(target=health)
        probe.start()
        with httpx.Client(timeout=120) as c:
            while not until.is_set() or len(self.chats) < min_chats:
                self.chats.append(short_chat(c, self.url))
        self.stop.set()
        probe.join()


def hostile_window(url: str, body_path: str) -> tuple[Window, tuple[str, str, float]]:
    proc = subprocess.Popen([sys.executable, "-c", _HOSTILE, url, body_path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    done = threading.Event()
    result: list[str] = []

    def post() -> None:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result.extend(proc.stdout.readline().split())
        done.set()

    window = Window(url)
    poster = threading.Thread(target=post)
    poster.start()
    window.run(done, min_chats=2)
    poster.join()
    proc.wait()
    return window, (result[0], result[1], float(result[2]))


def quiet_window(url: str, chats: int) -> Window:
    window = Window(url)
    done = threading.Event()
    done.set()
    window.run(done, min_chats=chats)
    return window


def run_once(args: argparse.Namespace, processes: int, body_path: str, chars: int, niceness: int | None) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(args.bundle), "--port", str(port),
                             "--threads", "1", "--log-level", "warning", "--tokenizer-processes", str(processes)],
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 **({} if niceness is None else {"LINESIDE_TOKENIZER_NICENESS": str(niceness)})})
    try:
        wait_ready(url, 120, alive=lambda: proc.poll() is None)
        with httpx.Client(timeout=120) as c:
            for _ in range(3):
                short_chat(c, url)
        rss_before = rss_mb(proc.pid)
        quiet: list[Window] = []
        hostile: list[Window] = []
        refusals: list[tuple[str, str, float]] = []
        for r in range(args.rounds):
            for kind in (("hostile", "quiet") if r % 2 else ("quiet", "hostile")):
                if kind == "hostile":
                    window, refusal = hostile_window(url, body_path)
                    hostile.append(window)
                    refusals.append(refusal)
                else:
                    quiet.append(quiet_window(url, chats=3))
        time.sleep(1.0)
        rss_after = rss_mb(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    q_chats = [x for w in quiet for x in w.chats]
    h_chats = [x for w in hostile for x in w.chats]
    statuses = sorted({f"{s} {c}" for s, c, _ in refusals})
    seconds = [t for _, _, t in refusals]
    print(f"prompt of {chars} characters: {', '.join(statuses)} in {min(seconds):.2f}-{max(seconds):.2f} s "
          f"(median {statistics.median(seconds):.2f} s, {len(seconds)} rounds)")
    for name, chats, windows in (("quiet  ", q_chats, quiet), ("hostile", h_chats, hostile)):
        health = [x for w in windows for x in w.health]
        print(f"  {name} windows: short chat p50 {statistics.median(chats) * 1000:.0f} ms, worst "
              f"{max(chats) * 1000:.0f} ms ({len(chats)} chats); /health worst {max(health) * 1000:.0f} ms "
              f"({len(health)} probes)")
    print(f"  delay (hostile - quiet): p50 {(statistics.median(h_chats) - statistics.median(q_chats)) * 1000:+.0f} "
          f"ms, worst {(max(h_chats) - max(q_chats)) * 1000:+.0f} ms")
    print(f"  server RSS: {rss_before:.0f} MB before, {rss_after:.0f} MB after ({rss_after - rss_before:+.0f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--mb", type=float, default=30.0)
    ap.add_argument("--chars", type=int, help="send this many characters of text instead of --mb")
    ap.add_argument("--text", choices=("varied", "word"), default="varied")
    ap.add_argument("--tokenizer-processes", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--niceness", type=int, nargs="+", default=[None],
                    help="LINESIDE_TOKENIZER_NICENESS values for the worker (each run in turn; default: the server's)")
    args = ap.parse_args()
    text = hostile_text(args)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"messages": [{"role": "user", "content": text}], "max_tokens": 8}, f)
    try:
        print(f"load average before: {os.getloadavg()[0]:.1f}")
        for processes in args.tokenizer_processes:
            for niceness in args.niceness if processes else [None]:
                shown = "" if niceness is None else f", worker niceness {niceness}"
                print(f"--tokenizer-processes {processes}{shown}")
                run_once(args, processes, f.name, len(text), niceness)
    finally:
        os.unlink(f.name)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
