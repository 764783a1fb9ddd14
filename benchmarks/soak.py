"""Soak: drive an in-process `lineside serve` app with thousands of varied requests and print how its resources and
stores grow — before, after each round, and after a pause. Prints numbers; asserts nothing.

    PYTHONPATH=. python benchmarks/soak.py BUNDLE [--rounds 4] [--per-round 500] [--pause 35] [--slots 4]

Each round mixes: chat and completions (streamed and not, n > 1, logprobs), json_schema with a new schema each
time (the grammar cache), /v1/responses with store and previous_response_id chains (the response store), prefill
sessions opened and abandoned (the session store), distinct prompts (the prefix cache), streams the client drops,
4xx errors, and distinct X-Request-Id / user / metadata values. Measured from /proc/self (the server shares this
process with the client, whose own use is a fixed pool of connections) and from the app's stores.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _stores(state, tasks: int) -> dict[str, float]:
    """Sizes of what the server keeps between requests."""
    engine = state.engine
    sched = engine.scheduler
    arena = sched.arena
    out = {"rss_mib": round(_rss_mib(), 1), "fds": _fds(), "threads": _threads(), "asyncio_tasks": tasks,
           "responses": len(state.responses), "sessions": len(sched.sessions.by_id) if sched.sessions else 0,
           "grammars": engine.grammar.cached, "grammar_refused": len(engine.grammar._refused),
           "prefix_index": len(arena._index), "engine_seqs": len(engine._seqs),
           "conn_by_client": 0, "template_cache": len(engine.tokenizer._compiled or {})}
    store_bytes = sum(len(repr(s.conversation)) + len(repr(s.input_items)) + len(repr(s.body))
                      for s in state.responses._by_id.values())
    out["responses_repr_kib"] = round(store_bytes / 1024, 1)
    out["gc_objects"] = len(gc.get_objects())
    return out


def _schema(i: int) -> dict:
    return {"type": "object", "properties": {f"f{i}": {"type": "integer"}}, "required": [f"f{i}"]}


async def _one(client: httpx.AsyncClient, i: int, rnd: random.Random, chains: list[str | None]) -> None:
    kind = i % 12
    words = " ".join(rnd.choice("alpha beta gamma delta eps zeta eta theta".split()) for _ in range(rnd.randint(3, 30)))
    head = {"X-Request-Id": f"req-{i}-{rnd.random()}"}
    meta = {"k": f"v{i}"}
    if kind == 0:
        await client.post("/v1/chat/completions", headers=head, json={
            "messages": [{"role": "user", "content": words}], "max_tokens": 8, "user": f"u{i}"})
    elif kind == 1:
        async with client.stream("POST", "/v1/completions", headers=head, json={
                "prompt": words, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}) as r:
            async for _ in r.aiter_lines():
                pass
    elif kind == 2:
        await client.post("/v1/completions", json={"prompt": words, "max_tokens": 6, "n": 3, "logprobs": 3,
                                                   "temperature": 1.0, "seed": i})
    elif kind == 3:
        await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": words}], "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _schema(i)}}})
    elif kind == 4:
        slot = i % len(chains)
        body = {"input": words, "max_output_tokens": 8, "metadata": meta, "store": True}
        if chains[slot]:
            body["previous_response_id"] = chains[slot]
        r = await client.post("/v1/responses", json=body)
        chains[slot] = r.json().get("id") if r.status_code == 200 else None
        if rnd.random() < 0.05:
            chains[slot] = None
    elif kind == 5:  # a session opened and abandoned
        await client.post("/v1/prefill", json={"prompt": words, "session_id": f"s{i}"})
    elif kind == 6:  # a stream the client drops after its first chunk
        async with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": words}], "max_tokens": 64, "stream": True}) as r:
            async for _ in r.aiter_lines():
                break
    elif kind == 7:  # 4xx: bad field, unknown model, bad JSON
        await client.post("/v1/chat/completions", json={"messages": [], "max_tokens": -1})
        await client.post("/v1/completions", json={"model": f"nope-{i}", "prompt": "x"})
        await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    elif kind == 8:
        async with client.stream("POST", "/v1/responses", json={
                "input": words, "max_output_tokens": 8, "stream": True, "metadata": meta}) as r:
            async for _ in r.aiter_lines():
                pass
    elif kind == 9:
        await client.post("/tokenize", json={"prompt": words})
    elif kind == 10:
        await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": words}], "max_tokens": 6,
            "structured_outputs": {"regex": f"[a-z]{{{1 + i % 200}}}"}})
    else:
        await client.post("/v1/completions", json={"prompt": f"{i} {words}", "max_tokens": 4, "stop": [" "]})


STATUSES: Counter[str] = Counter()  # "path status" of every answer the rounds got


async def _count(response: httpx.Response) -> None:
    STATUSES[f"{response.request.url.path} {response.status_code}"] += 1


async def _round(url: str, start: int, count: int, concurrency: int) -> None:
    rnd = random.Random(start)
    chains: list[str | None] = [None] * 8
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits,
                                 event_hooks={"response": [_count]}) as client:
        sem = asyncio.Semaphore(concurrency)

        async def run(i: int) -> None:
            async with sem:
                try:
                    await _one(client, i, rnd, chains)
                except httpx.HTTPError as e:
                    print(f"  request {i}: {type(e).__name__}: {e}", file=sys.stderr)

        await asyncio.gather(*(run(i) for i in range(start, start + count)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=500)
    ap.add_argument("--pause", type=float, default=35.0, help="seconds idle before the last reading (> session TTL)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()

    from fastapi import FastAPI

    from lineside.bench.inprocess import BackgroundServer
    from lineside.server.app import create_app
    from lineside.server.http_limits import HttpLimits, uvicorn_config

    app: FastAPI = create_app(args.bundle, num_slots=args.slots, threads=1)

    @app.get("/_soak/tasks")  # the benchmark's own hook (not the product's): asyncio tasks on the server's loop
    async def _tasks() -> dict:
        return {"tasks": len(asyncio.all_tasks())}

    def make_config(app, host, port):
        return uvicorn_config(app, host=host, port=port, limits=HttpLimits(), log_level="warning")

    with BackgroundServer(app, startup_timeout=120, make_config=make_config) as srv:
        state = app.state.lineside

        def reading(label: str) -> None:
            gc.collect()
            tasks = httpx.get(srv.url + "/_soak/tasks").json()["tasks"]
            print(label, _stores(state, tasks), flush=True)

        reading("before")
        done = 0
        for _ in range(args.rounds):
            t0 = time.monotonic()
            asyncio.run(_round(srv.url, done, args.per_round, args.concurrency))
            done += args.per_round
            reading(f"after {done} ({time.monotonic() - t0:.0f}s)")
        time.sleep(args.pause)
        reading(f"after a {args.pause:.0f}s pause")
        print("answers:", dict(sorted(STATUSES.items())))


if __name__ == "__main__":
    main()
