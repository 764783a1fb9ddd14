"""Cold start: time from spawning `lineside serve BUNDLE` to /health/ready answering 200, and the server's CPU.

Each variant is started `--runs` times, interleaved: "first" (onnxruntime's optimized-graph cache removed
first: what the first start after a build does), "cached" (the cache from an earlier start), "no-cache"
(LINESIDE_ORT_CACHE=0); `--variants` picks some. The servers' per-user cache (LINESIDE_CACHE_DIR, where a
read-only bundle keeps its verification record and optimized graphs) is a temporary folder, cleared for "first" too,
so a bundle on a read-only mount is measured as well. With `--tree DIR` (repeatable) the same is done for other checkouts of lineside
(PYTHONPATH=DIR), e.g. the commit before a change, so before/after come from one run.
Wall time is what a user waits; CPU seconds (the server and the worker processes it started, at ready) are
less sensitive to other work on a shared machine.
Python's bytecode is cached as an installed package has it (the server runs without PYTHONDONTWRITEBYTECODE,
its .pyc files in a temporary PYTHONPYCACHEPREFIX, written by one start of each checkout before the rounds):
otherwise every start would also compile lineside's sources (~0.1-0.2 s of CPU), which no user pays twice.

  python benchmarks/cold_start.py --bundle B [--runs 5] [--threads 2] [--tree OLD_CHECKOUT]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lineside.bench.inprocess import free_port  # noqa: E402

SUFFIX = ".ort-opt.onnx"  # lineside.runtime.ort_cache.SUFFIX (an old checkout may lack the module)


def server_env(tree: Path, pycache: Path, extra: dict[str, str]) -> dict[str, str]:
    """The server's environment: ``tree`` first on the path, bytecode cached under ``pycache``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **extra, "PYTHONPATH": str(tree), "PYTHONPYCACHEPREFIX": str(pycache)}


def start_once(bundle: Path, tree: Path, threads: int, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds to ready, server CPU seconds at ready); ``env``: the whole environment (server_env)."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(bundle), "--host", "127.0.0.1",
                             "--port", str(port), "--threads", str(threads), "--log-level", "warning"],
                            env=env, cwd="/")
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"lineside serve exited with {proc.returncode} before it was ready")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        cpu = sum(_cpu(pid) for pid in [proc.pid, *_descendants(proc.pid)])
    finally:
        proc.terminate()
        proc.wait()
    return wall, cpu


def _cpu(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """Processes the server started (its tokenizer worker), alive at ready: their CPU counts too."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
        for k in kids:
            out += [k, *_descendants(k)]
    return out


def clear_cache(bundle: Path, user_cache: Path) -> None:
    """What a fresh build leaves: no optimized-graph cache, no checksum stamps (lineside.checksum_cache), beside the
    bundle (unless it is read-only) or in the per-user cache."""
    for p in [*bundle.glob(f"graphs/*/*{SUFFIX}"), *bundle.glob(".lineside-verified.json")]:
        try:
            p.unlink()
        except OSError as e:
            raise SystemExit(f"cannot clear {p} ({e.strerror}): a read-only bundle's own cache stays; copy it "
                             f"without its *{SUFFIX} and .lineside-verified.json files") from None
    shutil.rmtree(user_cache, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", type=Path, action="append", default=[], help="another lineside checkout to compare")
    ap.add_argument("--variants", default="first,cached,no-cache", help="which of first, cached, no-cache to run")
    args = ap.parse_args()
    args.tree = [t.resolve() for t in args.tree]  # the servers run in /
    wanted = set(args.variants.split(","))
    variants: list[tuple[str, Path, dict[str, str], bool]] = []
    for tree in [ROOT, *args.tree]:
        tag = "" if tree == ROOT else f" [{tree}]"
        variants += [v for v in [(f"first{tag}", tree, {}, True), (f"cached{tag}", tree, {}, False),
                                 (f"no-cache{tag}", tree, {"LINESIDE_ORT_CACHE": "0"}, False)]
                     if v[0].split(" [")[0] in wanted]
    results: dict[str, list[tuple[float, float]]] = {v[0]: [] for v in variants}
    bundle = args.bundle.resolve()  # the servers run in /
    with tempfile.TemporaryDirectory(prefix="lineside-pycache-") as pycache, \
            tempfile.TemporaryDirectory(prefix="lineside-user-cache-") as user_dir:
        user_cache = {"LINESIDE_CACHE_DIR": user_dir}
        load0 = os.getloadavg()[0]
        for tree in [ROOT, *args.tree]:  # page cache warm for everyone, each checkout's bytecode written
            start_once(bundle, tree, args.threads, server_env(tree, Path(pycache), user_cache))
        for _ in range(args.runs):
            for name, tree, env, clear in variants:
                if clear:  # "first" runs right before "cached", which then finds the cache it wrote
                    clear_cache(bundle, Path(user_dir))
                results[name].append(start_once(bundle, tree, args.threads,
                                                server_env(tree, Path(pycache), {**user_cache, **env})))
    print(f"{bundle}: {args.runs} interleaved starts each, threads {args.threads}, bytecode cached, load average "
          f"{load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<48} {'wall to ready s':>15} {'server CPU s':>13}   wall runs  (CPU: server + its workers)")
    for name, rs in results.items():
        print(f"{name:<48} {statistics.median(r[0] for r in rs):>15.2f} {statistics.median(r[1] for r in rs):>13.2f}"
              f"   {[round(r[0], 2) for r in rs]}")


if __name__ == "__main__":
    main()
