"""Prefill sessions on the deterministic fake backend (its logits depend on every cached token of the slot, so a
session KV mixed up, cut wrong or reused stale changes the answer): equality with sending the prompt at once,
extension and divergence, lending and keeping for the next turn, the cap, TTL expiry on an injected clock,
release under memory pressure without failing a running request, drain, and the scheduling rule that session
chunks come after requests."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from lineside.errors import LinesideError
from lineside.runtime.engine import LLMEngine
from lineside.runtime.request import EngineDraining, GenerationRequest
from lineside.runtime.sessions import SessionLimitError, SessionStore
from tests.runtime.conftest import run
from tests.runtime.fakes import FakeBackend, FakeClock


def engine(bundle, slots=2, clock=None, max_seq_len=128, **kw) -> tuple[LLMEngine, FakeBackend]:
    be = FakeBackend(slots, max_seq_len=max_seq_len, clock=clock)
    return LLMEngine(bundle, backend=be, clock=clock or time.monotonic, **kw), be


async def settled(eng: LLMEngine, sid: str) -> None:
    """Until the session has no pending tokens (event-loop turns, no clock)."""
    while (info := eng.session(sid)) is not None and info.pending_tokens:
        await asyncio.sleep(0)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 250) for _ in range(n - 1)]


async def answer(eng: LLMEngine, ids: list[int], n: int = 12, **kw) -> list[int]:
    _, out, last = await eng.submit(GenerationRequest(prompt_ids=ids, max_tokens=n, **kw)).result()
    assert last.finish_reason in ("length", "stop"), last
    return out


def test_progressive_equals_at_once_and_counts_the_hit(tiny_bundle):
    ids = prompt(90)

    async def main():
        eng, _ = engine(tiny_bundle, slots=2, prefill_chunk=16)
        await eng.start()
        cold = await answer(eng, ids)
        eng2, be2 = engine(tiny_bundle, slots=2, prefill_chunk=16)
        await eng2.start()
        for end in (20, 47, 70, 88):  # the client's chunks: the session extends each time
            info = eng2.prefill("s1", ids[:end], end)
            assert info.cached_tokens + info.pending_tokens == end
            await settled(eng2, "s1")
        assert eng2.session("s1").cached_tokens == 88
        warm = await answer(eng2, ids, session_id="s1")
        st = eng2.stats()
        await eng.stop()
        await eng2.stop()
        return cold, warm, st, be2.calls

    cold, warm, st, calls = run(main())
    assert warm == cold
    assert st.session_hits == 1 and st.session_tokens_saved == 88 and st.session_prefill_tokens == 88
    assert st.sessions == 0 and st.session_pinned_blocks == 0  # ended with its completion (no keep_session)
    # the completion's own prefill: only the 2 tokens past the session (never a 1-token prefill)
    assert [new for _, past, new in calls if past == [88]] == [[2]]


def test_diverging_prefill_replaces_from_first_differing_token(tiny_bundle):
    ids = prompt(60, seed=1)
    other = ids[:30] + prompt(40, seed=2)[1:]

    async def main():
        eng, _ = engine(tiny_bundle, slots=2, prefill_chunk=16)
        await eng.start()
        eng.prefill("s", ids[:55], 55)
        await settled(eng, "s")
        info = eng.prefill("s", other[:60], 60)  # a later chunk rewrote text from token 30 on
        assert info.cached_tokens == 30 and info.pending_tokens == 30
        await settled(eng, "s")
        warm = await answer(eng, other, session_id="s")
        cold_eng, _ = engine(tiny_bundle, slots=1)
        await cold_eng.start()
        cold = await answer(cold_eng, other)
        await cold_eng.stop()
        await eng.stop()
        return warm, cold

    warm, cold = run(main())
    assert warm == cold


def test_completion_that_does_not_extend_falls_back_silently(tiny_bundle):
    async def main():
        eng, _ = engine(tiny_bundle, slots=2)
        await eng.start()
        eng.prefill("s", prompt(40, 3), 40)
        await settled(eng, "s")
        other = prompt(30, 4)
        warm = await answer(eng, [2, *other[1:]], session_id="s")  # differs from the first token
        unknown = await answer(eng, other, session_id="never-made")
        cold_eng, _ = engine(tiny_bundle, slots=1)
        await cold_eng.start()
        cold = (await answer(cold_eng, [2, *other[1:]]), await answer(cold_eng, other))
        st = eng.stats()
        await cold_eng.stop()
        await eng.stop()
        return (warm, unknown), cold, st

    got, cold, st = run(main())
    assert got == cold and st.session_hits == 0 and st.sessions == 0


def test_multi_turn_keeps_history_kv(tiny_bundle):
    async def main():
        eng, be = engine(tiny_bundle, slots=2, prefill_chunk=16)
        await eng.start()
        ref, _ = engine(tiny_bundle, slots=1, prefill_chunk=16)
        await ref.start()
        history = prompt(20, 5)
        recomputed = []
        for turn in range(5):
            start = len(be.calls)
            out = await answer(eng, history, n=6, session_id="chat", keep_session=True)
            assert out == await answer(ref, history, n=6)
            # prefill work of this turn: only what the session did not hold (the last turn's answer + new text)
            recomputed.append(sum(n[0] for _, past, n in be.calls[start:] if n[0] > 1))
            history = history + out + prompt(8, 10 + turn)[1:]
        st = eng.stats()
        await ref.stop()
        await eng.stop()
        return recomputed, st

    recomputed, st = run(main())
    assert recomputed[0] == 20 and all(r <= 6 + 8 + 1 for r in recomputed[1:])
    assert st.session_hits == 4 and st.sessions == 1


def test_session_expires_on_the_clock_and_frees_its_blocks(tiny_bundle):
    clock = FakeClock()

    async def main():
        eng, _ = engine(tiny_bundle, slots=2, clock=clock, session_ttl=30.0)
        await eng.start()
        eng.prefill("a", prompt(50), 50)
        await settled(eng, "a")
        st = eng.stats()
        assert st.sessions == 1 and st.session_pinned_blocks == 4 and st.kv_blocks_reserved == 4
        clock.advance(20)
        eng.prefill("a", prompt(50), 50)  # each call refreshes the TTL
        clock.advance(20)
        assert eng.session("a") is not None
        clock.advance(11)
        gone = eng.session("a")
        st = eng.stats()
        await eng.stop()
        return gone, st

    gone, st = run(main())
    assert gone is None
    assert (st.sessions, st.session_pinned_blocks, st.kv_blocks_reserved, st.kv_blocks_used) == (0, 0, 0, 0)
    assert st.sessions_expired == 1


def test_fifty_sessions_on_a_small_arena_never_fail_a_running_request(tiny_bundle):
    """50 sessions of ~1,000 tokens (context 1,024) on 3 slots and 160 blocks: requests decode throughout and
    each answers exactly as alone; sessions are released LRU when requests need room; after the TTL all is free."""
    clock = FakeClock()

    async def main():
        eng, _ = engine(tiny_bundle, slots=3, clock=clock, max_seq_len=1024, kv_blocks=160, session_ttl=30.0,
                        prefill_chunk=256, max_waiting=64)
        await eng.start()
        reqs = [prompt(30 + 7 * i, 100 + i) for i in range(9)]
        handles = []
        for i in range(50):
            eng.prefill(f"s{i}", prompt(1000, i), 998)
            if i % 6 == 0:
                handles.append(eng.submit(GenerationRequest(prompt_ids=reqs[i // 6], max_tokens=24)))
            for _ in range(3):
                await asyncio.sleep(0)
        outs = [await h.result() for h in handles]
        mid = eng.stats()
        clock.advance(31)
        end = eng.stats()
        ref, _ = engine(tiny_bundle, slots=1, max_seq_len=1024)
        await ref.start()
        solo = [await answer(ref, r, n=24) for r in reqs[:len(handles)]]
        await ref.stop()
        await eng.stop()
        return outs, solo, mid, end

    outs, solo, mid, end = run(main())
    assert [last.finish_reason for _, _, last in outs] == ["length"] * len(outs)
    assert [ids for _, ids, _ in outs] == solo
    assert mid.sessions <= 50 and mid.sessions_evicted > 0 and mid.kv_blocks_reserved <= 160
    assert (end.sessions, end.session_pinned_blocks, end.kv_blocks_reserved, end.kv_blocks_used) == (0, 0, 0, 0)


def test_cap_bad_ids_context_and_drain(tiny_bundle):
    async def main():
        eng, _ = engine(tiny_bundle, slots=2, max_sessions=2)
        await eng.start()
        eng.prefill("a", prompt(10), 10)
        eng.prefill("b", prompt(10), 10)
        eng.prefill("a", prompt(12), 12)  # an existing session is not a new one
        with pytest.raises(SessionLimitError, match="2 prefill sessions"):
            eng.prefill("c", prompt(10), 10)
        for bad in ("", "has space", "x" * 129, "-lead", "a\n", "x" * 128 + "\n"):  # $ matches before a last \n
            with pytest.raises(LinesideError, match="not a valid session id"):
                eng.prefill(bad, prompt(10), 10)
        with pytest.raises(LinesideError, match="context is 128"):
            eng.prefill("d", prompt(128), 120)
        assert eng.release_session("a") and not eng.release_session("a")
        stop = asyncio.ensure_future(eng.stop(drain_timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(EngineDraining, match="prefill sessions cannot be made"):
            eng.prefill("e", prompt(10), 10)
        await stop
        return eng.stats()

    st = run(main())
    assert st.sessions == 0


def test_keep_session_at_the_cap_replaces_the_least_recently_used_idle_session(tiny_bundle):
    """A completion whose keep_session makes a new session at --max-sessions was answered and its session silently
    not kept (the next turn recomputed everything); it now takes the place of the least recently used session no
    request holds (counted evicted), as a prefix cache does, and the next turn starts from its KV."""
    clock = FakeClock()

    async def main():
        eng, _ = engine(tiny_bundle, slots=3, clock=clock, max_sessions=2, prefill_chunk=16)
        await eng.start()
        for sid, seed in (("a", 1), ("b", 2), ("a", 1)):  # "a" used again after "b": "b" is the least recent
            eng.prefill(sid, prompt(20, seed), 20)
            await settled(eng, sid)
            clock.advance(1)
        history = prompt(24, 3)
        out = await answer(eng, history, n=4, session_id="c", keep_session=True)
        kept = {sid: eng.session(sid) is not None for sid in "abc"}
        hits = eng.stats().session_hits
        await answer(eng, history + out + prompt(6, 4)[1:], n=2, session_id="c", keep_session=True)
        st = eng.stats()
        await eng.stop()
        return kept, hits, st

    kept, hits, st = run(main())
    assert kept == {"a": True, "b": False, "c": True}
    assert st.sessions_evicted == 1 and st.session_hits == hits + 1 and st.sessions == 2


def test_keep_session_at_the_cap_with_every_session_in_use_is_not_kept():
    """No idle session to replace (each is lent to a running request): no running request's session is taken, so
    the new answer is not kept (its KV goes to the prefix cache). The store decides which session a kept answer
    replaces; an engine run can't hold a session lent while another request ends without racing the step thread."""
    store = SessionStore(ttl_s=10, max_sessions=2)
    a, b = store.open("a", 0.0), store.open("b", 1.0)
    a.touch(5.0)
    assert store.idlest() is b  # the least recently used of the idle ones
    b.lent_to = object()  # a running request holds it
    assert store.idlest() is a
    a.lent_to = object()
    assert store.idlest() is None

def test_pending_session_work_does_not_hold_up_shutdown(tiny_bundle):
    async def main():
        be = FakeBackend(2, max_seq_len=1024, delay=0.002)
        eng = LLMEngine(tiny_bundle, backend=be, prefill_chunk=16)
        await eng.start()
        eng.prefill("slow", prompt(1000), 1000)
        while not be.calls:  # the session's first chunk is running: stop meets work in flight
            await asyncio.sleep(0)
        t0 = time.monotonic()
        await eng.stop(drain_timeout=30)
        return time.monotonic() - t0, eng.stats()

    took, st = run(main())
    assert took < 5 and st.sessions == 0  # stop does not wait for the session's ~60 chunks


def test_session_chunks_yield_to_requests(tiny_bundle):
    """While a request decodes, session chunks run in at most one step in ``session_every``, and a request's
    prefill chunk is never beside a session chunk."""

    async def main():
        eng, be = engine(tiny_bundle, slots=3, prefill_chunk=32, session_every=4, session_busy_chunk=8)
        from collections import deque

        eng.step_log = deque()
        await eng.start()
        be.pause(lambda b: int(b.new_lengths.max()) == 1)  # h's first decode step waits for the session
        h = eng.submit(GenerationRequest(prompt_ids=prompt(40, 9), max_tokens=60))
        await be.until_paused()
        eng.prefill("s", prompt(120, 8), 120)
        plans = []
        orig = eng.scheduler.schedule

        def spy(now=None):
            plan = orig(now)
            plans.append((len(plan.decode), bool(plan.prefills),
                          0 if plan.session is None else len(plan.session.tokens)))
            return plan

        eng.scheduler.schedule = spy
        be.resume()
        await h.result()
        await settled(eng, "s")
        await eng.stop()
        return plans

    plans = run(main())
    busy = [p for p in plans if p[0] > 0]
    with_session = [p for p in busy if p[2]]
    assert with_session and all(p[2] <= 8 for p in with_session)  # session_busy_chunk while decoding
    assert len(with_session) * 4 <= len(busy) + 4
    assert not any(p[1] and p[2] for p in plans)


def test_higher_priority_session_computes_first(tiny_bundle):
    from lineside.runtime.request import Mode, Priority, rank_of

    async def main():
        eng, be = engine(tiny_bundle, slots=3, prefill_chunk=16)
        eng.prefill("low", prompt(60, 1), 60, rank=rank_of(Priority.LOW, Mode.BATCH))
        eng.prefill("high", prompt(60, 2), 60, rank=rank_of(Priority.HIGH, Mode.REALTIME))
        await eng.start()
        await settled(eng, "low")
        await settled(eng, "high")
        await eng.stop()
        return be.calls

    calls = run(main())
    session_calls = [(slots[0], past[0]) for slots, past, new in calls[2:] if new[0] > 1]  # after the warm-up
    # the slots were given high first (lowest slot), and all of high's chunks ran before low's
    high_slot = session_calls[0][0]
    order = [slot == high_slot for slot, _ in session_calls]
    assert order == sorted(order, reverse=True) and order.count(True) == 4


class WholeStateBackend(FakeBackend):
    """A backend whose decode state is replaced whole each step (as DeepSeek-V4's compressor state)."""

    def __init__(self, *a, **kw):
        from types import SimpleNamespace

        from lineside.graph_io import StateUpdate

        super().__init__(*a, **kw)
        self.states = [SimpleNamespace(update=StateUpdate.REPLACE)]


def test_whole_state_models_refuse_sessions_in_one_line(tiny_bundle):
    from lineside.runtime.sessions import SessionsUnsupported

    async def main():
        eng = LLMEngine(tiny_bundle, backend=WholeStateBackend(2))
        await eng.start()
        with pytest.raises(SessionsUnsupported) as e:
            eng.prefill("v4", prompt(20), 20)
        out = await answer(eng, prompt(20), session_id="v4", keep_session=True)  # runs as any request
        st = eng.stats()
        await eng.stop()
        return str(e.value), out, st

    msg, out, st = run(main())
    assert "\n" not in msg and "whole-state tensors" in msg and "completion endpoint" in msg
    assert len(out) == 12 and st.sessions == 0


def test_session_lent_to_a_preempted_request_ends_with_it(tiny_bundle):
    """A batch completion holding a session's slot is preempted by a realtime one, then cancelled while it
    waits: the session it held ends too (nothing stays pinned), and the realtime answer is the plain one."""
    from lineside.runtime.request import Mode

    async def main():
        eng, be = engine(tiny_bundle, slots=1, prefill_chunk=16)
        await eng.start()
        eng.prefill("b", prompt(40, 3), 40)
        await settled(eng, "b")
        be.pause(lambda b: int(b.new_lengths.max()) == 1)  # the batch request's first decode step waits
        batch = eng.submit(GenerationRequest(prompt_ids=prompt(44, 3), max_tokens=100, mode=Mode.BATCH,
                                             session_id="b"))
        await be.until_paused()
        assert eng.stats().session_hits == 1
        rt_prompt = prompt(20, 4)
        rt_handle = eng.submit(GenerationRequest(prompt_ids=rt_prompt, max_tokens=12))
        # then the realtime request's first decode step waits: the engine stands with it running, batch waiting
        be.resume(then=lambda b: int(b.new_lengths.max()) == 1 and be.kv[0, :len(rt_prompt)].tolist() == rt_prompt)
        await be.until_paused()
        assert rt_handle.metrics.token_times
        assert batch.metrics.preemptions == 1 and eng.stats().waiting == 1  # the batch one waits, slotless
        batch.cancel()
        be.resume()
        _, _, last = await batch.result()
        _, rt, _ = await rt_handle.result()
        st = eng.stats()
        ref, _ = engine(tiny_bundle, slots=1)
        await ref.start()
        want = await answer(ref, prompt(20, 4))
        await ref.stop()
        await eng.stop()
        return rt, want, last, st

    rt, want, last, st = run(main())
    assert rt == want and last.finish_reason == "cancelled"
    assert st.sessions == 0 and st.session_pinned_blocks == 0 and st.kv_blocks_reserved == 0


@pytest.mark.parametrize("lent", [True, False])
def test_a_session_deleted_while_its_completion_runs_stays_deleted(tiny_bundle, lent):
    """DELETE while a keep_session completion naming the session runs (on the session's KV, or beside it when its
    prompt differs): the completion finishes as usual, and when it ends the session is not made again from its KV —
    DELETE answered that it ended, so nothing stays pinned until a TTL the client no longer expects."""
    ids = prompt(40, 3)

    async def main():
        eng, be = engine(tiny_bundle, slots=2, prefill_chunk=16)
        await eng.start()
        eng.prefill("b", ids, 40)
        await settled(eng, "b")
        be.pause(lambda b: int(b.new_lengths.max()) == 1)  # the completion's first decode step waits
        asked = ids + prompt(5, 4)[1:] if lent else [2, *prompt(44, 5)[1:]]
        h = eng.submit(GenerationRequest(prompt_ids=asked, max_tokens=5, session_id="b", keep_session=True))
        await be.until_paused()
        hits = eng.stats().session_hits
        assert eng.release_session("b") is True and eng.session("b") is None
        be.resume()
        _, out, _ = await h.result()
        st, info = eng.stats(), eng.session("b")
        ref, _ = engine(tiny_bundle, slots=1)
        await ref.start()
        want = await answer(ref, asked, n=5)
        await ref.stop()
        await eng.stop()
        return hits, out, want, st, info

    hits, out, want, st, info = run(main())
    assert hits == int(lent) and out == want
    assert info is None and st.sessions == 0 and st.session_pinned_blocks == 0 and st.kv_blocks_reserved == 0


def test_the_cap_retry_after_is_the_soonest_expiry_of_a_session_that_can_expire():
    """A session lent to a running request does not expire, even past its TTL: the 429's Retry-After once came from
    its stale expiry (0 s: 'retry in 1 s', for a server still full then)."""

    store = SessionStore(ttl_s=10, max_sessions=2)
    store.open("lent", now=0.0).lent_to = object()  # in use by a running completion
    store.open("idle", now=5.0)  # expires at 15
    with pytest.raises(SessionLimitError) as full:
        store.open("new", now=12.0)
    assert full.value.retry_after_s == pytest.approx(3.0)
    store.by_id["idle"].lent_to = object()  # both in use: none expires until its request ends
    with pytest.raises(SessionLimitError) as full:
        store.open("new", now=20.0)
    assert full.value.retry_after_s == pytest.approx(10.0)
