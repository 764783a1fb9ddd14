"""Where the guard sends a request: the fallback when the level and the policy say so and the request fits it —
its context and its vocabulary — else the primary."""

from __future__ import annotations

import asyncio
import datetime as dt

from lineside.runtime.request import Mode, Priority
from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import Pin, SloPolicy


class FakeEngine:
    def __init__(self, max_seq_len: int, vocab_size: int) -> None:
        self.max_seq_len, self.vocab_size = max_seq_len, vocab_size

    async def start(self) -> None:
        pass


def test_a_request_the_fallback_cannot_read_stays_on_the_primary():
    """One tokenizer, fewer embedding rows in the fallback (R1-Distill-Qwen-1.5B behind -7B): a token-id prompt past
    them was routed there and refused (400 'token id 290 is out of vocabulary'), though the primary serves it."""
    async def scenario() -> None:
        guard = SloGuard(SloPolicy(pins=(Pin(start=dt.time(0), end=dt.time(23, 59, 59), level=2),)),
                         fallback=FakeEngine(256, 280), fallback_name="small", device=lambda: (None, None),
                         local_time=lambda: dt.time(12), ticking=False)
        await guard.start(FakeEngine(256, 300), "big")
        assert guard.tick(device=(None, None)) == 2
        route = dict(mode=Mode.REALTIME, priority=Priority.NORMAL)
        assert guard.route(**route, tokens=8, top_token=279).fallback
        assert not guard.route(**route, tokens=8, top_token=290).fallback
        assert not guard.route(**route, tokens=300, top_token=5).fallback  # past its context: the primary too

    asyncio.run(scenario())
