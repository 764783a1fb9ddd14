"""The first burst of N concurrent streams into a fresh `lineside serve` vs the same burst again, per checkout.

What `served_side_by_side.py --concurrency N` measures is one burst into a server that has only served one
stream at a time, so it is the first time slots 1..N-1 are used; this separates that first burst from a warm
one. Each round starts a fresh server per checkout (alternately), streams one 128-token greedy completion, then
the burst twice: aggregate tokens/s (end to end), the server's CPU ms per token (/proc, all threads) and its
VmRSS before and after the first burst; the burst's texts are checked against each other and the first
stream's against the lone stream.

    python benchmarks/first_burst.py --bundle B [--tree OLD_CHECKOUT] [--rounds 3] [--streams 8] [--spin 1]

Timing only: no pass/fail.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_per_token import proc_cpu  # noqa: E402
from benchmarks.served_side_by_side import PROMPT, concurrent, stream_completion  # noqa: E402
from lineside.bench.inprocess import free_port, wait_ready  # noqa: E402

COLOURS = ("red", "blue", "green", "gold", "grey", "pink", "teal", "white", "black", "brown", "amber", "olive")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def one_server(bundle: Path, tree: Path, *, threads: int, spin: str, streams: int, tokens: int) -> tuple:
    import httpx

    prompts = [f"{PROMPT} {COLOURS[i % len(COLOURS)]}" for i in range(streams)]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(bundle), "--host", "127.0.0.1",
                             "--port", str(port), "--threads", str(threads), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=str(tree),
                            env={**os.environ, "LINESIDE_ORT_SPIN": spin, "PYTHONPATH": str(tree)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 600, alive=lambda: proc.poll() is None)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        lone = stream_completion(url, model, prompts[0], tokens)
        r0, c0 = rss_mb(proc.pid), proc_cpu(proc.pid)
        agg1, first = concurrent(url, model, prompts, tokens)
        r1, c1 = rss_mb(proc.pid), proc_cpu(proc.pid)
        agg2, second = concurrent(url, model, prompts, tokens)
        c2 = proc_cpu(proc.pid)
        same = first[0].text == lone.text and all(a.text == b.text for a, b in zip(first, second, strict=True))
        n1, n2 = sum(s.tokens for s in first), sum(s.tokens for s in second)
        return (lone.tokens / lone.end_s, agg1, agg2, (c1 - c0) / n1 * 1e3, (c2 - c1) / n2 * 1e3, r0, r1, same)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--tree", type=Path, action="append", default=[], help="another checkout, same rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin", default="1", help="LINESIDE_ORT_SPIN (default 1: what `serve` does)")
    a = ap.parse_args()
    trees = {"this checkout": ROOT, **{str(t): t for t in a.tree}}
    res: dict[str, list[tuple]] = {k: [] for k in trees}
    load0 = os.getloadavg()[0]
    for _ in range(a.rounds):
        for name, tree in trees.items():
            r = one_server(a.bundle.resolve(), tree, threads=a.threads, spin=a.spin, streams=a.streams,
                           tokens=a.tokens)
            res[name].append(r)
            print(f"{name}: 1 stream {r[0]:.1f} tok/s; first burst {r[1]:.1f} tok/s ({r[3]:.2f} CPU ms/token), "
                  f"second {r[2]:.1f} ({r[4]:.2f}); RSS {r[5]:.0f} -> {r[6]:.0f} MB; texts identical {r[7]}",
                  flush=True)
    print(f"# {a.streams} streams x {a.tokens} tokens, {a.threads} threads, spin {a.spin}, {a.rounds} rounds, "
          f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}; medians")
    for name, rs in res.items():
        def m(i: int, rs: list[tuple] = rs) -> float:
            return statistics.median(r[i] for r in rs)
        print(f"{name}: 1 stream {m(0):.1f} tok/s; first burst {m(1):.1f} ({m(1) / m(0):.2f}x, {m(3):.2f} CPU "
              f"ms/token); second burst {m(2):.1f} ({m(2) / m(0):.2f}x, {m(4):.2f}); RSS {m(5):.0f} -> {m(6):.0f} MB; "
              f"texts identical {all(r[7] for r in rs)}")


if __name__ == "__main__":
    main()
