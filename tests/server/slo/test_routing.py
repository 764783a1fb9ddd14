"""Where the guard sends a request: the fallback when the level and the policy say so and the request fits it —
its context and its vocabulary — else the primary."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from types import SimpleNamespace

from lineside.runtime.request import GenerationRequest, Mode, Priority
from lineside.runtime.structured import Constraint
from lineside.server.slo import routing
from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import Pin, SloPolicy


class FakeEngine:
    def __init__(self, max_seq_len: int, vocab_size: int) -> None:
        self.max_seq_len, self.vocab_size = max_seq_len, vocab_size

    async def start(self) -> None:
        pass


async def level2_guard(fallback: FakeEngine, primary: FakeEngine) -> SloGuard:
    """A guard pinned at level 2 all day (the fallback serves what fits it), started on ``primary``."""
    guard = SloGuard(SloPolicy(pins=(Pin(start=dt.time(0), end=dt.time(23, 59, 59), level=2),)),
                     fallback=fallback, fallback_name="small", device=lambda: (None, None),
                     local_time=lambda: dt.time(12), ticking=False)
    await guard.start(primary, "big")
    assert guard.tick(device=(None, None)) == 2
    return guard


def test_a_request_the_fallback_cannot_read_stays_on_the_primary():
    """One tokenizer, fewer embedding rows in the fallback (R1-Distill-Qwen-1.5B behind -7B): a token-id prompt past
    them was routed there and refused (400 'token id 290 is out of vocabulary'), though the primary serves it."""
    async def scenario() -> None:
        guard = await level2_guard(FakeEngine(256, 280), FakeEngine(256, 300))
        route = dict(mode=Mode.REALTIME, priority=Priority.NORMAL)
        assert guard.route(**route, tokens=8, top_token=279).fallback
        assert not guard.route(**route, tokens=8, top_token=290).fallback
        assert not guard.route(**route, tokens=300, top_token=5).fallback  # past its context: the primary too

    asyncio.run(scenario())


class GrammarEngine(FakeEngine):
    """Records the thread its grammar compiler is built and its constraints compiled on."""

    def __init__(self, max_seq_len: int, vocab_size: int) -> None:
        super().__init__(max_seq_len, vocab_size)
        self.threads: list[int] = []
        self.compiled: list[Constraint] = []

    @property
    def grammar(self) -> GrammarEngine:
        self.threads.append(threading.get_ident())
        return self

    def compile(self, constraint: Constraint) -> None:
        self.threads.append(threading.get_ident())
        self.compiled.append(constraint)


def test_a_structured_request_sent_to_the_fallback_compiles_its_grammar_off_the_event_loop():
    """The fallback builds its grammar compiler on first use (about a second on a real vocabulary); routed there,
    a structured request's constraint is compiled in a worker thread, not by ``submit`` on the event loop."""
    async def scenario() -> None:
        fallback, primary = GrammarEngine(256, 300), GrammarEngine(256, 300)
        guard = await level2_guard(fallback, primary)
        schema = Constraint.json_schema({"type": "object"})
        requests = [GenerationRequest(prompt_ids=[1, 2], max_tokens=4, constraint=schema),
                    GenerationRequest(prompt_ids=[3], max_tokens=4)]
        body = SimpleNamespace(stream=True, model="big")
        slo_plan = await routing.plan(guard, body, requests=requests, output=None, chat=True,
                                      priority=Priority.NORMAL, mode=Mode.REALTIME, n=1, response_id="r",
                                      draining=lambda: False)
        assert slo_plan.route.engine is fallback and fallback.compiled == [schema]
        assert fallback.threads and threading.get_ident() not in fallback.threads
        assert primary.threads == []  # the primary's constraints were compiled before routing, by the caller

    asyncio.run(scenario())


def test_a_logit_bias_past_the_fallbacks_vocabulary_stays_on_the_primary():
    """A logit_bias id the primary has but the fallback's smaller embedding lacks: the fallback's sampler skips it,
    so the answer silently ignored the bias. Such a request is the primary's, as a prompt id past it is."""
    from lineside.runtime.sampling import SamplingParams

    async def scenario() -> tuple[bool, bool]:
        guard = await level2_guard(FakeEngine(256, 280), FakeEngine(256, 300))
        body = SimpleNamespace(stream=True, model="big")

        async def to_fallback(bias: tuple[tuple[int, float], ...]) -> bool:
            r = GenerationRequest(prompt_ids=[1, 2], max_tokens=4, sampling=SamplingParams(logit_bias=bias))
            plan = await routing.plan(guard, body, requests=[r], output=None, chat=True, priority=Priority.NORMAL,
                                      mode=Mode.REALTIME, n=1, response_id="r", draining=lambda: False)
            return plan.route.fallback

        return await to_fallback(((279, 5.0),)), await to_fallback(((290, -100.0),))

    assert asyncio.run(scenario()) == (True, False)
