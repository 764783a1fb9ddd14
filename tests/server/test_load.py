"""64 concurrent streaming clients with mixed priorities through the openai client: every one completes
with exactly the single-stream greedy output (nothing lost or mixed up), high priority reaches its first
token sooner than low, and a client that leaves mid-stream frees its slot (visible in /metrics)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx
import openai
import pytest

from lineside.runtime.generate import Generator
from tests.server.conftest import make_engine, metric, running_server

N_CLIENTS = 64
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def load_server(tiny_bundle):
    with running_server(make_engine(tiny_bundle, num_slots=4)) as srv:
        yield srv


def _jobs() -> list[dict]:
    rng = random.Random(7)
    prios = ["high", "normal", "low"] * (N_CLIENTS // 3 + 1)
    rng.shuffle(prios)
    return [{"i": i, "prompt": f"client {i}: " + "ab cd ef "[: 3 + i % 7], "chat": i % 2 == 1,
             "priority": prios[i]} for i in range(N_CLIENTS)]


async def _one(client: openai.AsyncOpenAI, job: dict, t0: float) -> dict:
    headers = {"X-Priority": job["priority"], "X-Request-Id": f"load-{job['i']}"}
    kw = dict(model="tiny-llama", max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
              extra_headers=headers)
    start = time.perf_counter()
    if job["chat"]:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": job["prompt"]}], **kw)
    else:
        stream = await client.completions.create(prompt=job["prompt"], **kw)
    text, first, finish, usage = [], None, None, None
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        if not ch.choices:
            continue
        c = ch.choices[0]
        piece = (c.delta.content or "") if job["chat"] else c.text
        if piece and first is None:
            first = time.perf_counter()
        text.append(piece)
        finish = c.finish_reason or finish
    return {**job, "text": "".join(text), "ttft": (first or time.perf_counter()) - start, "finish": finish,
            "usage": usage, "queued_at": start - t0}


async def _leaver(url: str) -> int:
    """Starts a long stream, reads a few chunks, then drops the connection; returns chunks read."""
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", url + "/v1/completions", headers={"X-Priority": "high"},
                            json={"prompt": "leaving", "max_tokens": 200, "temperature": 0, "stream": True}) as r:
            n = 0
            async for line in r.aiter_lines():
                n += bool(line)
                if n == 3:
                    return n
    return n


def test_64_streaming_clients_mixed_priorities(load_server, tiny_bundle):
    jobs = _jobs()
    gen = Generator(tiny_bundle, threads=1)
    expected = {}
    for j in jobs:
        r = gen.generate(j["prompt"], max_tokens=MAX_TOKENS, chat=j["chat"])
        expected[j["i"]] = (r.text, r.finish_reason)

    async def go():
        client = openai.AsyncOpenAI(base_url=load_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, j, t0)) for j in jobs]
        leaver = asyncio.create_task(_leaver(load_server.url))
        out = await asyncio.gather(*tasks)
        await leaver
        await client.close()
        return out

    results = asyncio.run(go())
    assert len(results) == N_CLIENTS
    for r in results:
        text, reason = expected[r["i"]]
        assert r["text"] == text, f"client {r['i']} got a different output"
        assert r["finish"] == reason
        assert r["usage"] is not None and r["usage"].completion_tokens >= 1
    ttft = {p: statistics.median(r["ttft"] for r in results if r["priority"] == p) for p in ("high", "low")}
    assert ttft["high"] < ttft["low"], ttft

    def settled():
        m = httpx.get(load_server.url + "/metrics").text
        return m if metric(m, "lineside_num_requests_running") == 0 else None

    deadline = time.monotonic() + 5
    while not (m := settled()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert m, "requests still running after every client finished"
    finished = sum(metric(m, "lineside_requests_total", f'outcome="{o}"') for o in ("stop", "length"))
    assert finished == N_CLIENTS
    assert metric(m, "lineside_requests_total", 'outcome="cancelled"') == 1  # the client that left
    assert metric(m, "lineside_num_requests_waiting") == 0
    stats = load_server.state.engine.stats()
    print("median TTFT", ttft, "engine", stats)
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_reserved == 0
