"""Level 1's batch gate: a batch request for the primary waits while requests wait in its queue or the running
batch is at the cap, and goes in (never dropped) once there is room; at level 0 it never waits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from lineside.runtime.request import Mode, Priority
from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import SloPolicy


@dataclass
class Stats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


class FakePrimary:
    """Only what the gate reads: stats() whose waiting count the test sets."""

    max_seq_len = 256

    def __init__(self) -> None:
        self.current = Stats()
        self.polled = asyncio.Event()  # set each time the gate reads stats()

    def stats(self) -> Stats:
        self.polled.set()
        return self.current


class FakeHandle:
    def __init__(self) -> None:
        self.finished = False


async def _blocked(task: asyncio.Task, primary: FakePrimary, polls: int = 3) -> bool:
    """Still held after the gate has read the primary's stats ``polls`` more times: the gate decides."""
    for _ in range(polls):
        primary.polled.clear()
        await asyncio.wait_for(primary.polled.wait(), 10)
    await asyncio.sleep(0)  # let a gate that just decided to admit finish doing so
    return not task.done()


def test_batch_waits_for_realtime_and_the_cap_at_level_1():
    async def scenario() -> None:
        now = [0.0]
        guard = SloGuard(SloPolicy(batch_running_cap=1, fallback_modes=(), min_samples=1), clock=lambda: now[0],
                         device=lambda: (None, None), ticking=False)
        primary = FakePrimary()
        await guard.start(primary, "primary")
        route = guard.route(mode=Mode.BATCH, priority=Priority.NORMAL, tokens=8)
        await asyncio.wait_for(guard.admit_batch(route, draining=lambda: False), 1)  # level 0: straight in

        guard.signals.observe(ttft_s=1.0, queue_s=0.0)
        assert guard.tick(device=(None, None)) == 1
        route = guard.route(mode=Mode.BATCH, priority=Priority.NORMAL, tokens=8)
        assert not route.fallback  # the policy names no batch traffic for a fallback (and there is none)
        primary.current = Stats(running=4, waiting=2)  # realtime requests wait
        first = asyncio.create_task(guard.admit_batch(route, draining=lambda: False))
        assert await _blocked(first, primary)
        primary.current = Stats(running=4, waiting=0)
        await asyncio.wait_for(first, 1)
        handle = FakeHandle()
        guard.admitted(handle, Mode.BATCH, fallback=False)
        second = asyncio.create_task(guard.admit_batch(route, draining=lambda: False))
        assert await _blocked(second, primary)  # the running batch is at its cap of 1
        handle.finished = True
        await asyncio.wait_for(second, 1)
        assert guard.metrics.registry.get_sample_value("lineside_slo_batch_held_total") == 2

        draining = [False]
        primary.current = Stats(running=4, waiting=3)
        third = asyncio.create_task(guard.admit_batch(route, draining=lambda: draining[0]))
        assert await _blocked(third, primary)
        draining[0] = True  # the drain lets it through to the engine, which answers 503 draining
        await asyncio.wait_for(third, 1)
        await guard.stop()

    asyncio.run(scenario())


def test_the_gate_counts_its_held_requests_against_the_queue_bound_and_lets_a_gone_client_go():
    """Held requests are waiting ones: with the primary's queue and the held ones at its max_waiting the next is
    refused at once (QueueFullError: the server's 429), and one whose client disconnects ends (ClientGone) and
    frees its place, without waiting for the gate to open."""
    from lineside.runtime.request import QueueFullError
    from lineside.server.slo.guard import ClientGone

    async def scenario() -> None:
        guard = SloGuard(SloPolicy(fallback_modes=(), min_samples=1), clock=lambda: 0.0,
                         device=lambda: (None, None), ticking=False)
        primary = FakePrimary()
        primary.max_waiting = 3
        await guard.start(primary, "primary")
        guard.signals.observe(ttft_s=1.0, queue_s=0.0)
        assert guard.tick(device=(None, None)) == 1
        route = guard.route(mode=Mode.BATCH, priority=Priority.NORMAL, tokens=8)
        primary.current = Stats(running=4, waiting=1)
        left = asyncio.Event()
        first = asyncio.create_task(guard.admit_batch(route, draining=lambda: False, client_gone=left.wait))
        second = asyncio.create_task(guard.admit_batch(route, draining=lambda: False))
        assert await _blocked(first, primary) and await _blocked(second, primary)
        assert guard.held == 2
        with pytest.raises(QueueFullError, match="3 requests are already waiting"):
            await asyncio.wait_for(guard.admit_batch(route, draining=lambda: False), 1)
        left.set()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(first, 1)
        assert guard.held == 1 and not second.done()
        third = asyncio.create_task(guard.admit_batch(route, draining=lambda: False))  # room again
        assert await _blocked(third, primary)
        primary.current = Stats(running=4, waiting=0)
        await asyncio.wait_for(asyncio.gather(second, third), 1)
        assert guard.held == 0
        await guard.stop()

    asyncio.run(scenario())
