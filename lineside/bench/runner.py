"""Run a schedule against a server: open-loop arrivals at their times, or N closed-loop workers.

Every run is bounded in count (the schedule) and in time (`deadline`): requests still in flight at
the deadline are cancelled and recorded as failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from lineside.bench.client import KEY_HINT, ClientConfig, first_model, send
from lineside.bench.load import Schedule
from lineside.bench.metrics import RequestRecord
from lineside.bench.prompts import PromptPool
from lineside.errors import LinesideError


@dataclass
class RunResult:
    """Records of one run plus its wall time (seconds) and the model the requests named."""

    records: list[RequestRecord]
    duration: float
    model: str
    started_at: float  # time.time() at the start, for the report header


async def _open_loop(client, cfg, schedule: Schedule, pool: PromptPool, t0: float,
                     deadline: float) -> list[asyncio.Task]:
    tasks = []
    for a in schedule.arrivals:
        if a.time >= deadline:
            break
        delay = a.time - (cfg.clock() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(client, cfg, pool.take(a.prompts), t0)))
    return tasks


async def _closed_loop(client, cfg, schedule: Schedule, pool: PromptPool, t0: float,
                       records: list[RequestRecord]) -> None:
    issued = 0

    def more() -> bool:
        nonlocal issued
        if schedule.max_requests and issued >= schedule.max_requests:
            return False
        if schedule.duration and cfg.clock() - t0 >= schedule.duration:
            return False
        issued += 1
        return True

    async def worker() -> None:
        while more():
            start = cfg.clock() - t0
            try:
                records.append(await send(client, cfg, pool.take(1), t0))
            except asyncio.CancelledError:  # the run's deadline: in flight, so failed (as the open loop's)
                records.append(RequestRecord(start=start, end=cfg.clock() - t0,
                                             error="cancelled at the run's deadline"))
                raise

    await asyncio.gather(*(worker() for _ in range(schedule.concurrency)))


async def _reachable(client: httpx.AsyncClient, url: str) -> None:
    """With --model given nothing was asked of the server before the run: a server that is down cost the whole
    --duration and ended as "no request succeeded". One GET first; only no connection (or no HTTP on it) is refused:
    an error status or a slow answer comes from a server that is up (some gateways do not list models)."""
    try:
        await client.get(url + "/v1/models")
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
        raise LinesideError(f"cannot reach {url} ({type(e).__name__}: {e or 'no answer'}); is the server running "
                            "and is --url right?") from None


async def run_async(url: str, schedule: Schedule, pool: PromptPool, cfg: ClientConfig,
                    deadline: float, warmup: int = 0, at_start: Callable[[], object] | None = None) -> RunResult:
    """Execute the schedule; `deadline` (s from start) caps the whole run including the drain. `at_start` runs
    after the warm-up, right before the clock starts: what it reads of the server (its counters) leaves the warm-up
    out, as every other number does."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), limits=limits, headers=cfg.headers()) as client:
        model = cfg.model
        if model:
            await _reachable(client, url)
        else:
            try:
                model = await first_model(client, url)
            except httpx.HTTPStatusError as e:
                if e.response.status_code != 401:
                    raise LinesideError(f"cannot list models at {url}/v1/models (HTTP {e.response.status_code}); "
                                        "is it an OpenAI-compatible server? or pass --model") from None
                raise LinesideError(f"{url}/v1/models answered 401 ("
                                    f"{'a wrong key' if cfg.api_key else 'it wants an API key'}); {KEY_HINT}") from None
            except (httpx.HTTPError, ValueError, KeyError) as e:
                raise LinesideError(f"cannot list models at {url}/v1/models ({type(e).__name__}: {e}); "
                                   "is the server running? or pass --model") from None
        cfg = ClientConfig(**{**cfg.__dict__, "base_url": url, "model": model})
        for _ in range(warmup):
            await send(client, cfg, pool.take(1), cfg.clock())
        if at_start is not None:
            await asyncio.to_thread(at_start)  # a blocking read of the server: not on the loop's thread
        started = time.time()
        t0 = cfg.clock()
        records: list[RequestRecord] = []
        if schedule.closed_loop:
            work = asyncio.ensure_future(_closed_loop(client, cfg, schedule, pool, t0, records))
            done, _ = await asyncio.wait({work}, timeout=deadline)
            if not done:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        else:
            scheduler = asyncio.ensure_future(_open_loop(client, cfg, schedule, pool, t0, deadline))
            tasks = await scheduler
            remaining = max(0.0, deadline - (cfg.clock() - t0))
            done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            now = cfg.clock() - t0
            for t in tasks:
                if t in done:
                    records.append(t.result())
            for a, t in zip(schedule.arrivals, tasks, strict=False):
                if t in pending:
                    records.append(RequestRecord(start=a.time, end=now, prompts=a.prompts,
                                                 error="cancelled at the run's deadline"))
        duration = cfg.clock() - t0
    return RunResult(records=records, duration=duration, model=model, started_at=started)


def run(url: str, schedule: Schedule, pool: PromptPool, cfg: ClientConfig, deadline: float,
        warmup: int = 0, at_start: Callable[[], object] | None = None) -> RunResult:
    """Blocking wrapper around run_async (a fresh event loop)."""
    return asyncio.run(run_async(url, schedule, pool, cfg, deadline, warmup, at_start))
