"""CPU seconds per generated token: in-process (Generator, LLMEngine) and served (`lineside serve`), by thread.

Wall-clock tokens/s on a machine shared with other work measures the other work; the CPU a path spends
per token does not (much): less CPU per token on a loaded machine is more tokens/s on a quiet one.
Each path generates greedy 128-token completions of one prompt; its process CPU (all threads, from
/proc) over those runs is divided by the tokens generated. The server is a subprocess, so the client's
own parsing is not counted; per-thread CPU of the server is reported too (event loop = the main thread,
the step worker, onnxruntime's pool threads). onnxruntime spinning is off by default here
(``LINESIDE_ORT_SPIN=0``): a spinning thread burns CPU while it waits, which is not work.
With ``--ops`` the decode step's onnxruntime kernels are counted from an onnxruntime profile.

  python benchmarks/cpu_per_token.py --bundle B [--threads 2] [--rounds 3] [--streams 1,8]
      [--paths generator,engine,served] [--tree OLD_CHECKOUT] [--ops]

``--tree DIR`` runs the served path of another checkout (PYTHONPATH=DIR) in the same rounds: before/after
from one run. Timing only: no pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.served_side_by_side import PROMPT, concurrent, stream_completion  # noqa: E402
from lineside.bench.inprocess import free_port, wait_ready  # noqa: E402

PROMPTS = [PROMPT, "The three laws of thermodynamics say that", "Write a short story about a robot who",
           "In 1905, a clerk at the patent office", "The best way to brew coffee at home is",
           "Here is a recipe for bread:", "A list of the planets, from the sun outwards:",
           "The history of the printing press begins"]
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """utime + stime of a whole process (exited threads included), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu(pid: int) -> dict[int, float]:
    """Per live thread: on-CPU seconds (schedstat, ns resolution)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def per_thread(pid: int, before: dict[int, float], after: dict[int, float], tokens: int) -> str:
    """Thread CPU per token, ms, main thread first then largest first."""
    d = {t: after[t] - before.get(t, 0.0) for t in after}
    main = d.pop(pid, 0.0)
    rest = sorted((v for v in d.values() if v * 1e3 / tokens >= 0.01), reverse=True)
    return "main " + f"{main * 1e3 / tokens:.2f}" + "".join(f" / {v * 1e3 / tokens:.2f}" for v in rest)


def served(bundle: Path, threads: int, tree: Path, streams: int, max_tokens: int, env: dict[str, str]):
    """A `lineside serve` subprocess of checkout ``tree``; returns a function running one measured batch."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="cpu-per-token-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(bundle), "--host", "127.0.0.1",
                             "--port", str(port), "--threads", str(threads), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(tree),
                            env={**os.environ, **env, "PYTHONPATH": str(tree)})
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 600, alive=lambda: proc.poll() is None)
    import httpx

    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    stream_completion(url, model, PROMPT, 8)  # first request: lazy imports, first allocations

    def run() -> tuple[float, int, str, list[str]]:
        c0, t0 = proc_cpu(proc.pid), thread_cpu(proc.pid)
        rate, got = concurrent(url, model, [PROMPTS[i % len(PROMPTS)] for i in range(streams)], max_tokens)
        c1, t1 = proc_cpu(proc.pid), thread_cpu(proc.pid)
        tokens = sum(s.tokens for s in got)
        return (c1 - c0) / tokens, rate, per_thread(proc.pid, t0, t1, tokens), [s.text for s in got]

    def stop() -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    return run, stop


def generator(bundle: Path, threads: int, max_tokens: int):
    """lineside's direct single-stream loop (runtime/generate.py) in this process."""
    from lineside.runtime.generate import Generator
    from lineside.runtime.sampling import SamplingParams

    gen = Generator(bundle, threads=threads)
    ids = gen.tokenizer.encode(PROMPT)
    list(gen.stream(ids, max_tokens=8, params=SamplingParams()))

    def run() -> tuple[float, int, str, list[str]]:
        pid = os.getpid()
        t0, c0, w0 = thread_cpu(pid), time.process_time(), time.perf_counter()
        toks = list(gen.stream(ids, max_tokens=max_tokens, params=SamplingParams()))
        wall = time.perf_counter() - w0
        c1, t1 = time.process_time(), thread_cpu(pid)
        return ((c1 - c0) / len(toks), len(toks) / wall, per_thread(pid, t0, t1, len(toks)),
                [gen.tokenizer.decode(toks)])

    return run, gen.backend.close


def engine(bundle: Path, threads: int, streams: int, max_tokens: int):
    """The serving engine (runtime/engine.py: scheduler, step worker, sampler, detokenizer) without HTTP."""
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest

    loop = asyncio.new_event_loop()
    eng = LLMEngine(bundle, backend="onnxruntime", threads=threads, num_slots=max(8, streams))
    loop.run_until_complete(eng.start())

    async def batch(n: int, tokens: int) -> list[tuple[str, int]]:
        handles = [eng.submit(GenerationRequest(prompt_ids=eng.tokenizer.encode(PROMPTS[i % len(PROMPTS)]),
                                                max_tokens=tokens, ignore_eos=True)) for i in range(n)]
        return [(text, len(ids)) for text, ids, _ in await asyncio.gather(*(h.result() for h in handles))]

    loop.run_until_complete(batch(1, 8))

    def run() -> tuple[float, int, str, list[str]]:
        pid = os.getpid()
        t0, c0, w0 = thread_cpu(pid), time.process_time(), time.perf_counter()
        out = loop.run_until_complete(batch(streams, max_tokens))
        wall = time.perf_counter() - w0
        c1, t1 = time.process_time(), thread_cpu(pid)
        tokens = sum(n for _, n in out)
        return (c1 - c0) / tokens, tokens / wall, per_thread(pid, t0, t1, tokens), [t for t, _ in out]

    def stop() -> None:
        loop.run_until_complete(eng.stop(drain_timeout=1))
        loop.close()

    return run, stop


def profile_session(be: OnnxRuntimeBackend, threads: int) -> None:
    """Swap the backend's session for one that records an onnxruntime profile (same graph, threads, no spin);
    ``be.session.end_profiling()`` then names the trace file."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ops")
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if be.session._model_path.endswith(".ort-opt.onnx"):  # the cached optimized graph: run it as it is, like
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the backend (ort_cache.py)
    be.session = ort.InferenceSession(be.session._model_path, so, providers=["CPUExecutionProvider"])
    be._fast.clear()  # the cached decode bindings belong to the old session


def step_kernels(trace: list[dict], steps: int) -> tuple[list[dict], list[dict]]:
    """An onnxruntime profile's last ``steps`` runs and the kernel events from the first of them on."""
    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"][-steps:]
    t0 = runs[0]["ts"]
    return runs, [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= t0]


def op_label(op: str, node: str) -> str:
    """The op type, with the LM head apart from the other MatMulNBits and the GGUF Q4_1 carry's nodes (block
    sums, the Concat of x and its block sums, block offsets or residuals and the cast of a float16 residual, the
    Add) apart from the others."""
    if op == "MatMulNBits" and ("embed_tokens" in node or "lm_head" in node):
        return "MatMulNBits (head)"
    if op == "MatMul" and "blocksum" in node:
        return "MatMul (Q4_1 block sums)"
    if op == "Concat" and "with_block_sums" in node:
        return "Concat (Q4_1 block sums)"
    if op in ("MatMul", "MatMulNBits") and ("q4_1_offset" in node or "q4_1_residual" in node):
        return f"{op} (Q4_1 offsets)"
    if op == "Cast" and "block_residual" in node:  # the float16 residual, cast per call by onnxruntime
        return "Cast (Q4_1 offsets)"
    if op == "Add" and "q4_1_add" in node:
        return "Add (Q4_1 offsets)"
    return op


def count_ops(bundle: Path, threads: int, batch: int) -> None:
    """Kernels per decode step (onnxruntime profile of 16 steps after a warm-up) and the most frequent."""
    import numpy as np

    from lineside.bundle import open_bundle
    from lineside.runtime.backend import StepBatch
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    be = OnnxRuntimeBackend(open_bundle(bundle), num_slots=batch, threads=threads, spin=False)
    profile_session(be, threads)
    be.forward(StepBatch(slots=list(range(batch)), input_ids=np.ones((batch, 16), np.int64),
                         past_lengths=np.zeros(batch, np.int64), new_lengths=np.full(batch, 16, np.int64),
                         logits_positions=np.full((batch, 1), 15, np.int64)))
    steps = 16
    for i in range(steps + 4):
        be.forward(StepBatch(slots=list(range(batch)), input_ids=np.ones((batch, 1), np.int64),
                             past_lengths=np.full(batch, 16 + i, np.int64), new_lengths=np.ones(batch, np.int64),
                             logits_positions=np.zeros((batch, 1), np.int64)))
    last, nodes = step_kernels(json.loads(Path(be.session.end_profiling()).read_text()), steps)
    by_op: dict[str, list[float]] = {}
    for e in nodes:
        by_op.setdefault(op_label(e["args"]["op_name"], e["name"]), []).append(e["dur"])
    per_step = len(nodes) / steps
    run_us = statistics.median(e["dur"] for e in last)
    print(f"batch {batch}: {per_step:.0f} kernels per decode step, model_run median {run_us / 1e3:.2f} ms")
    for op, durs in sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"  {op:<32} {len(durs) / steps:>6.0f}/step  {sum(durs) / steps / 1e3:>6.2f} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, action="append", required=True,
                    help="repeat to run the generator path on several bundles in the same rounds (others: the first)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", default="1,8", help="concurrent streams for the engine and served paths")
    ap.add_argument("--paths", default="generator,engine,served")
    ap.add_argument("--tree", type=Path, action="append", default=[], help="another checkout to serve, same rounds")
    ap.add_argument("--spin", default="0", help="LINESIDE_ORT_SPIN for every path (default 0: off)")
    ap.add_argument("--ops", action="store_true", help="count onnxruntime kernels per decode step (batch 1 and 8)")
    args = ap.parse_args()
    os.environ["LINESIDE_ORT_SPIN"] = args.spin
    if args.ops:
        for bundle in args.bundle:
            for b in (1, 8):
                print(bundle)
                count_ops(bundle, args.threads, b)
        return
    paths = args.paths.split(",")
    streams = [int(s) for s in args.streams.split(",")]
    runners: dict[str, tuple] = {}
    try:
        if "generator" in paths:
            for b in args.bundle:
                runners["generator" + ("" if b == args.bundle[0] else f" [{b.name}]")] = generator(b, args.threads,
                                                                                                 args.tokens)
        bundle = args.bundle[0]
        for n in streams:
            if "engine" in paths:
                runners[f"engine x{n}"] = engine(bundle, args.threads, n, args.tokens)
            if "served" in paths:
                for tree in [ROOT, *args.tree]:
                    name = f"served x{n}" + ("" if tree == ROOT else f" [{tree.name}]")
                    runners[name] = served(bundle, args.threads, tree, n, args.tokens,
                                           {"LINESIDE_ORT_SPIN": args.spin})
        results: dict[str, list[tuple[float, str]]] = {k: [] for k in runners}
        rates: dict[str, list[float]] = {k: [] for k in runners}
        texts: dict[str, list[str]] = {}
        for _ in range(args.rounds):
            for name, (run, _stop) in runners.items():
                cpu, rate, threads, out = run()
                results[name].append((cpu, threads))
                rates[name].append(rate)
                texts.setdefault(name, out)
    finally:
        for _run, stop in runners.values():
            stop()
    print(f"# CPU ms per generated token ({args.threads} threads, spin={args.spin}, {args.tokens} tokens, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.1f})")
    for name, rs in results.items():
        cpus = [c for c, _ in rs]
        mid = sorted(rs)[len(rs) // 2]
        print(f"{name:<28} {statistics.median(cpus) * 1e3:6.2f} ms/token  (min {min(cpus) * 1e3:.2f})  "
              f"{statistics.median(rates[name]):6.1f} tok/s wall  threads ms/token: {mid[1]}")
    for n in streams:
        base, many = texts.get("served x1"), texts.get(f"served x{n}")
        if n > 1 and base and many:
            print(f"served x{n} first text equals served x1's: {many[0] == base[0]}")


if __name__ == "__main__":
    main()
