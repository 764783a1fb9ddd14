"""SIGTERM to a `lineside serve` subprocess during generation: in-flight (and queued) requests finish,
new ones get 503, readiness goes 503, and the process exits 0; past --drain-timeout the rest is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from lineside.bench.inprocess import free_port, wait_ready
from lineside.errors import LinesideError


def _start(bundle, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LINESIDE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(bundle), "--host", "127.0.0.1",
                             "--port", str(port), "--threads", "1", "--log-level", "info", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 60, alive=lambda: proc.poll() is None)
    except LinesideError as e:
        proc.kill()
        pytest.fail(f"{e}: {proc.stdout.read()}")
    return proc, url


class Accepted:
    """The streams the server answered 200; ``all`` is set once every one of ``n`` was."""

    def __init__(self, n: int) -> None:
        self.n, self.ids, self.all = n, [], asyncio.Event()

    def add(self, i: int) -> None:
        self.ids.append(i)
        if len(self.ids) >= self.n:
            self.all.set()


async def _stream(c: httpx.AsyncClient, url: str, i: int, max_tokens: int, started: asyncio.Event,
                  accepted: Accepted) -> dict:
    events = []
    async with c.stream("POST", url + "/v1/completions", json={"prompt": f"drain {i}", "max_tokens": max_tokens,
                                                               "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        accepted.add(i)  # the server answered 200: the request is in the engine
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
            started.set()
    return {"events": events}


async def _scenario(url: str, proc: subprocess.Popen, n: int, max_tokens: int):
    async with httpx.AsyncClient(timeout=60) as c:
        started, accepted = asyncio.Event(), Accepted(n)
        tasks = [asyncio.create_task(_stream(c, url, i, max_tokens, started, accepted)) for i in range(n)]
        await asyncio.wait_for(started.wait(), 30)
        # on a loaded machine some requests reach the server late (a 503 after SIGTERM): wait until every one
        # was answered 200, or one failed
        with contextlib.suppress(TimeoutError):  # a stream that failed shows in the checks below
            await asyncio.wait_for(accepted.all.wait(), 60)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        refused = await c.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
        ready = await c.get(url + "/health/ready")
        results = await asyncio.gather(*tasks)
    return refused, ready, results


def test_sigterm_drains_in_flight_and_refuses_new(tiny_bundle):
    # 24 x 230 tokens through one slot: a few seconds of work (the tiny model does ~0.5 ms a token)
    proc, url = _start(tiny_bundle, "--num-slots", "1", "--drain-timeout", "60")
    try:
        refused, ready, results = asyncio.run(_scenario(url, proc, 24, 230))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert len(results) == 24
        for r in results:  # running and queued requests all finished normally
            ev = r["events"]
            assert ev[-1] == "[DONE]"
            assert ev[-2]["choices"][0]["finish_reason"] in ("stop", "length")
            assert not any("error" in e for e in ev[:-1])
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        assert "draining" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_drain_timeout_cancels_the_rest(tiny_bundle):
    proc, url = _start(tiny_bundle, "--num-slots", "1", "--drain-timeout", "0.2")
    try:
        t0 = time.monotonic()
        refused, _, results = asyncio.run(_scenario(url, proc, 24, 230))
        assert refused.status_code == 503
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 20
        cut = [r for r in results if any(isinstance(e, dict) and "error" in e for e in r["events"])]
        assert cut, "nothing was cancelled by the drain timeout"
        for r in cut:
            assert r["events"][-1] == "[DONE]"
            err = next(e for e in r["events"] if isinstance(e, dict) and "error" in e)["error"]
            assert err["code"] == "cancelled"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_signal_cancels_what_is_in_flight_and_exits_cleanly(tiny_bundle):
    """The second SIGTERM (or Ctrl-C) of a drain: uvicorn's own forced exit cut streams with no error event and
    logged a CancelledError traceback per response; now each answer ends with the `cancelled` error and [DONE],
    and the process exits 0 without a traceback."""
    proc, url = _start(tiny_bundle, "--num-slots", "1", "--drain-timeout", "60")
    try:
        async def scenario() -> list[dict]:
            async with httpx.AsyncClient(timeout=60) as c:
                started, accepted = asyncio.Event(), Accepted(24)
                tasks = [asyncio.create_task(_stream(c, url, i, 230, started, accepted)) for i in range(24)]
                await asyncio.wait_for(started.wait(), 30)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(accepted.all.wait(), 60)
                proc.send_signal(signal.SIGTERM)
                for _ in range(1000):  # the second signal once the first one's drain has begun (readiness says so)
                    if (await c.get(url + "/health/ready")).status_code == 503:
                        break
                else:
                    raise AssertionError("the first SIGTERM never started a drain")
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        results = asyncio.run(scenario())
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        assert "Traceback" not in out and "CancelledError" not in out, out
        cut = [r for r in results if any(isinstance(e, dict) and "error" in e for e in r["events"])]
        assert cut, "the second signal cancelled nothing (the drain had 60 s)"
        for r in results:  # every stream ends properly: finished, or cancelled with its error event
            assert r["events"][-1] == "[DONE]"
        for r in cut:
            err = next(e for e in r["events"] if isinstance(e, dict) and "error" in e)["error"]
            assert err["code"] == "cancelled"
    finally:
        if proc.poll() is None:
            proc.kill()
