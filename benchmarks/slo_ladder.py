"""The SLO ladder end to end: `lineside serve BUNDLE --fallback FALLBACK` with short thresholds, pushed over them
by concurrent long prompts, then left alone to recover. Prints the level timeline from /health, which bundle
answered (`model`) and with which `X-Lineside-Degraded` header in each phase, errors, and the transitions counted
in /metrics. Timing only: no pass/fail.

    python benchmarks/slo_ladder.py BUNDLE FALLBACK [--level1-ttft 0.3] [--level2-ttft 0.8] [--recover-after 3]
                                    [--concurrency 8] [--prompt-chars 3000] [--load-seconds 15] [--threads 1]

FALLBACK needs BUNDLE's tokenizer (a copy of BUNDLE under another name works to watch the mechanism).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from lineside.bench.inprocess import free_port, wait_ready
from lineside.errors import LinesideError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("fallback", type=Path)
    ap.add_argument("--level1-ttft", type=float, default=0.3)
    ap.add_argument("--level2-ttft", type=float, default=0.8)
    ap.add_argument("--recover-after", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=3000)
    ap.add_argument("--load-seconds", type=float, default=15.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-slots", type=int, default=2)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="slo-ladder-"))
    policy = tmp / "policy.yaml"
    policy.write_text(f"level_1: {{ttft_p90_s: {args.level1_ttft}}}\nlevel_2: {{ttft_p90_s: {args.level2_ttft}}}\n"
                      f"window_s: 5\nmin_samples: 3\ntick_s: 0.25\nrecover_after_s: {args.recover_after}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(args.bundle), "--port", str(port),
                               "--fallback", str(args.fallback), "--slo-policy", str(policy), "--threads",
                               str(args.threads), "--num-slots", str(args.num_slots), "--log-level", "warning"],
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    try:
        wait_ready(url, 300, alive=lambda: server.poll() is None)
        run(url, args)
    except LinesideError as e:  # the server said why above (a bundle it refused): one line here, no traceback
        sys.exit(f"slo_ladder: {e}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def run(url: str, args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    timeline: list[tuple[float, int, str]] = []
    answers: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    phase = ["load"]
    stop_load = threading.Event()
    stop_watch = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop_watch.is_set():
                slo = client.get(f"{url}/health").json()["slo"]
                if not timeline or timeline[-1][1] != slo["level"]:
                    timeline.append((time.monotonic() - t0, slo["level"], slo["reason"]))
                time.sleep(0.1)

    long_prompt = ("The line stopped at station four because the torque reading drifted. " * 100)[:args.prompt_chars]

    def load(i: int) -> None:
        with httpx.Client(timeout=300) as client:
            while not stop_load.is_set():
                r = client.post(f"{url}/v1/completions", json={"prompt": f"{i} {long_prompt}", "max_tokens": 8})
                if r.status_code != 200:
                    errors[(phase[0], r.status_code)] += 1
                    continue
                answers[(phase[0], r.json()["model"], r.headers.get("x-lineside-degraded", "-"))] += 1

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    workers = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(args.concurrency)]
    for w in workers:
        w.start()
    time.sleep(args.load_seconds)
    stop_load.set()
    for w in workers:
        w.join()
    load_end = time.monotonic() - t0
    phase[0] = "recovery"
    deadline = time.monotonic() + 10 * args.recover_after + 30
    while time.monotonic() < deadline and (not timeline or timeline[-1][1] != 0):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "status?", "max_tokens": 4}, timeout=60)
        answers[(phase[0], r.json()["model"], r.headers.get("x-lineside-degraded", "-"))] += 1
        time.sleep(0.5)
    stop_watch.set()
    watcher.join()
    metrics = httpx.get(f"{url}/metrics", timeout=5).text

    print(f"policy: level 1 at TTFT P90 > {args.level1_ttft} s, level 2 > {args.level2_ttft} s, "
          f"recover after {args.recover_after} s; {args.concurrency} clients x {args.prompt_chars}-char prompts "
          f"for {args.load_seconds} s (load ended at t={load_end:.1f} s)")
    print("level timeline (t from the start of the load):")
    for t, level, reason in timeline:
        print(f"  t={t:6.2f} s  level {level}  ({reason})")
    print("answers by phase, model, X-Lineside-Degraded:")
    for (ph, model, header), count in sorted(answers.items()):
        print(f"  {ph:9} {model:24} {header:>2}  {count}")
    print(f"errors: {dict(errors) or 'none'}")
    print("transitions in /metrics:")
    for line in metrics.splitlines():
        if line.startswith("lineside_slo_transitions_total{") and not line.endswith(" 0.0"):
            print("  " + line)


if __name__ == "__main__":
    main()
