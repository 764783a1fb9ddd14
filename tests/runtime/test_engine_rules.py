"""Each scheduling rule on a deterministic fake backend (fast, exact). Rules that depend on time (aging,
timeouts, drain) run on a FakeClock that each model step moves on by ``step_s``: nothing sleeps to make
time pass, so a busy machine can't change the outcome."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.errors import LinesideError
from lineside.runtime.engine import LLMEngine
from lineside.runtime.request import EngineDraining, GenerationRequest, QueueFullError
from lineside.runtime.sampling import SamplingParams
from lineside.runtime.tokenizer import Tokenizer
from tests.runtime.conftest import run
from tests.runtime.fakes import FakeBackend, FakeClock, submit_after


def engine(bundle, slots=2, delay=0.0, clock=None, step_s=0.0, **kw) -> tuple[LLMEngine, FakeBackend]:
    """An engine on the fake backend; with ``clock``, each step takes ``step_s`` simulated seconds."""
    be = FakeBackend(slots, max_seq_len=kw.pop("max_seq_len", 128), delay=delay, clock=clock, step_s=step_s)
    return LLMEngine(bundle, backend=be, clock=clock or time.monotonic, **kw), be


def decoding(batch) -> bool:
    """A decode step (one new token per row): with ``FakeBackend.pause``, the engine waits after a first token."""
    return int(batch.new_lengths.max()) == 1


async def first_token(h) -> None:
    """Wait (on the event loop, not the clock) until ``h`` has produced a token."""
    while not h.metrics.token_times:
        await asyncio.sleep(0)


def req(prompt, n=8, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_tokens=n, **kw)


PROMPTS = [[1, 5 + i] + list(range(10 + i, 10 + i + 3 * i)) for i in range(6)]


async def alone(bundle, r: GenerationRequest, **kw):
    eng, _ = engine(bundle, slots=1, **kw)
    await eng.start()
    out = await eng.submit(GenerationRequest(**{**r.__dict__, "request_id": r.request_id + "-solo"})).result()
    await eng.stop()
    return out


def test_batched_equals_one_at_a_time(tiny_bundle):
    reqs = [req(p, n=3 + 2 * i) for i, p in enumerate(PROMPTS)]

    async def main():
        eng, be = engine(tiny_bundle, slots=3, prefill_chunk=4)
        await eng.start()
        outs = await asyncio.gather(*(eng.submit(r).result() for r in reqs))
        st = eng.stats()
        await eng.stop()
        solo = [await alone(tiny_bundle, r) for r in reqs]
        return outs, solo, st, be.calls

    outs, solo, st, calls = run(main())
    assert all(slots == list(range(slots[0], slots[0] + len(slots))) for slots, _, _ in calls)  # bound in place
    assert any(len(slots) >= 2 for slots, _, _ in calls)
    for (t, ids, last), (t2, ids2, last2) in zip(outs, solo, strict=True):
        assert ids == ids2 and t == t2 and last.finish_reason == last2.finish_reason == "length"
    assert st.running == 0 and st.kv_blocks_reserved == 0 and st.requests == {"length": 6}
    assert st.generated_tokens_total == sum(3 + 2 * i for i in range(6))


def test_priority_order_realtime_before_batch(tiny_bundle):
    async def main():
        eng, _ = engine(tiny_bundle, slots=1, aging_s=1e9)
        order = [("low", "realtime"), ("normal", "batch"), ("normal", "realtime"), ("high", "batch"),
                 ("high", "realtime")]
        hs = [eng.submit(req(PROMPTS[i], n=2, priority=p, mode=m)) for i, (p, m) in enumerate(order)]
        await eng.start()
        await asyncio.gather(*(h.result() for h in hs))
        await eng.stop()
        return [order[i] for i in sorted(range(len(hs)), key=lambda i: hs[i].metrics.scheduled)]

    assert run(main()) == [("high", "realtime"), ("normal", "realtime"), ("low", "realtime"),
                           ("high", "batch"), ("normal", "batch")]


def test_aging_lets_low_priority_through(tiny_bundle):
    async def main():
        clock = FakeClock()
        eng, be = engine(tiny_bundle, slots=1, clock=clock, step_s=0.01, aging_s=0.05)
        await eng.start()
        be.pause(decoding)  # busy's first decode step waits until high is in
        busy = eng.submit(req(PROMPTS[0], n=20))
        low = eng.submit(req(PROMPTS[1], n=2, priority="low"))
        await first_token(busy)
        clock.advance(0.15)  # low has waited 3 aging periods: it now ranks above a fresh "high"
        high = eng.submit(req(PROMPTS[2], n=2, priority="high"))
        be.resume()
        await asyncio.gather(busy.result(), low.result(), high.result())
        await eng.stop()
        return low.metrics.scheduled < high.metrics.scheduled

    assert run(main())


def test_admission_waits_for_free_slot_and_blocks(tiny_bundle):
    async def main():
        # 2 slots but only 4 blocks of 16: one request reserving 40 positions (3 blocks) at a time.
        eng, be = engine(tiny_bundle, slots=2, clock=FakeClock(), step_s=0.005, kv_block_size=16, kv_blocks=4)
        await eng.start()
        be.pause(decoding)  # a's first decode step waits while the stats are read
        a = eng.submit(req(PROMPTS[0], n=38))
        b = eng.submit(req(PROMPTS[1], n=37))
        await first_token(a)
        st = eng.stats()
        be.resume()
        await asyncio.gather(a.result(), b.result())
        await eng.stop()
        return st, a.metrics, b.metrics

    st, ma, mb = run(main())
    assert st.running == 1 and st.waiting == 1 and st.kv_blocks_reserved == 3
    assert mb.scheduled >= ma.finished


def test_cancel_frees_capacity(tiny_bundle):
    async def main():
        eng, be = engine(tiny_bundle, slots=1, clock=FakeClock(), step_s=0.002)
        await eng.start()
        be.pause(lambda b: decoding(b) and int(b.past_lengths[0]) == len(PROMPTS[0]) + 2)  # after 3 tokens
        long = eng.submit(req(PROMPTS[0], n=100))
        nxt = eng.submit(req(PROMPTS[1], n=3))
        got = []
        async for ev in long:
            got.append(ev)
            if len(got) == 3:
                long.cancel()  # the step already waiting runs, the next one sees the cancel
                be.resume()
        text, ids, last = await nxt.result()
        st = eng.stats()
        await eng.stop()
        return got, last, st

    got, last, st = run(main())
    assert got[-1].finish_reason == "cancelled" and len(got) <= 5
    assert last.finish_reason == "length" and last.completion_tokens == 3
    assert st.requests == {"cancelled": 1, "length": 1} and st.kv_blocks_reserved == 0


def test_cancel_while_waiting(tiny_bundle):
    async def main():
        eng, be = engine(tiny_bundle, slots=1, clock=FakeClock(), step_s=0.002)
        await eng.start()
        be.pause(decoding)  # a can't finish before b is cancelled
        a = eng.submit(req(PROMPTS[0], n=20))
        b = eng.submit(req(PROMPTS[1], n=20))
        b.cancel()
        be.resume()
        evs = [ev async for ev in b]
        await a.result()
        await eng.stop()
        return evs, b.metrics

    evs, m = run(main())
    assert [e.finish_reason for e in evs] == ["cancelled"] and m.scheduled is None


def test_timeout_running_and_waiting(tiny_bundle):
    async def main():
        eng, _ = engine(tiny_bundle, slots=1, clock=FakeClock(), step_s=0.01)
        a = eng.submit(req(PROMPTS[0], n=100, timeout_s=0.15))
        b = eng.submit(req(PROMPTS[1], n=5, timeout_s=0.05))  # both queued before the step thread runs
        await eng.start()
        ra, rb = await asyncio.gather(a.result(), b.result())
        await eng.stop()
        return ra, rb

    (_, ids_a, last_a), (_, ids_b, last_b) = run(main())
    assert last_a.finish_reason == "timeout" and 0 < len(ids_a) < 100
    assert last_b.finish_reason == "timeout" and ids_b == []


def scripted(tiny_bundle, text: str, prompt=(1, 40, 41)):
    eng, be = engine(tiny_bundle, slots=2)
    be.scripts[tuple(prompt)] = eng.tokenizer.encode(text, add_special=False)
    return eng, list(prompt)


def test_stop_string_split_across_tokens(tiny_bundle):
    async def main():
        eng, prompt = scripted(tiny_bundle, "Hello wor<|END|> more")
        await eng.start()
        evs = [ev async for ev in eng.submit(req(prompt, n=50, stop=["<|END|>", "zzz"]))]
        await eng.stop()
        return evs

    evs = run(main())
    assert "".join(e.text for e in evs) == "Hello wor"
    assert not any("<" in e.text for e in evs)
    assert evs[-1].finish_reason == "stop" and evs[-1].completion_tokens == len("Hello wor<|END|>")


def test_held_back_text_released_at_the_end(tiny_bundle):
    async def main():
        eng, prompt = scripted(tiny_bundle, "abc <|EN")
        await eng.start()
        r1 = await eng.submit(req(prompt, n=50, stop=["<|END|>"])).result()
        r2 = await eng.submit(req(prompt, n=6, stop=["<|END|>"])).result()
        await eng.stop()
        return r1, r2

    (t1, _, l1), (t2, _, l2) = run(main())
    assert (t1, l1.finish_reason) == ("abc <|EN", "stop")  # EOS after the script: held text is output
    assert (t2, l2.finish_reason) == ("abc <|", "length")


def test_eos_stop_token_ids_and_ignore_eos(tiny_bundle):
    async def main():
        eng, prompt = scripted(tiny_bundle, "xyz")
        await eng.start()
        tok = eng.tokenizer.encode("y", add_special=False)[0]
        r1 = await eng.submit(req(prompt, n=10)).result()
        r2 = await eng.submit(req(prompt, n=10, stop_token_ids=[tok])).result()
        r3 = await eng.submit(req(prompt, n=6, ignore_eos=True)).result()
        await eng.stop()
        return r1, r2, r3

    (t1, i1, l1), (t2, i2, l2), (t3, i3, l3) = run(main())
    assert (t1, l1.finish_reason, len(i1), l1.completion_tokens) == ("xyz", "stop", 3, 4)
    assert (t2, l2.finish_reason, len(i2)) == ("x", "stop", 1)
    assert (l3.finish_reason, len(i3)) == ("length", 6) and t3.startswith("xyz")


def test_min_tokens_holds_eos_stop_tokens_and_stop_strings_back(tiny_bundle):
    """vLLM's min_tokens: the script ends in EOS after 3 tokens, but EOS is masked (ignore_eos or not) and
    stop_token_ids and stop strings do not end the answer until min_tokens tokens are out; then they do."""
    y = Tokenizer.from_bundle(open_bundle(tiny_bundle)).encode("y", add_special=False)[0]

    async def main():
        eng, prompt = scripted(tiny_bundle, "xyxy")
        await eng.start()
        outs = [await eng.submit(req(prompt, n=10, sampling=SamplingParams(min_tokens=m), **kw)).result()
                for m, kw in [(6, {}), (2, {"stop_token_ids": [y]}), (2, {"stop": ["xy"]}), (2, {"stop": ["yx"]}),
                              (3, {"stop": ["yx"]}), (10, {"ignore_eos": True})]]
        await eng.stop()
        return outs

    (t1, i1, l1), (t2, i2, l2), (t3, _, l3), (t4, _, l4), (t4b, _, l4b), (t5, i5, l5) = run(main())
    assert (t1[:4], l1.finish_reason, len(i1), l1.completion_tokens) == ("xyxy", "stop", 6, 7)  # 2 past the script
    assert 2 not in i1 and 2 not in i5  # EOS never sampled, ignore_eos or not (as vLLM's all_stop_token_ids)
    # the stop token id y is masked as token 2 (the model's next best comes instead); the second y ends the answer
    assert (t2, l2.finish_reason, len(i2)) == ("xx", "stop", 3) and i2[1] != y
    assert (t3, l3.finish_reason) == ("xy", "stop")  # "xy" ended in the first 2 tokens; the second one stops
    assert (t4, l4.finish_reason) == ("x", "stop")  # "yx" begins in token 2, ends in token 3: stops, from its start
    assert (t4b, l4b.finish_reason) == ("xyxy", "stop")  # ... ends within min_tokens 3: output; then EOS ends it
    assert (l5.finish_reason, len(i5)) == ("length", 10)


@pytest.mark.parametrize("text", ["你好，世界", "emoji 😀🚀 ok", "mixed 日本語 ✓ 👩‍👩‍👧"])
def test_utf8_never_broken(tiny_bundle, text):
    async def main():
        eng, prompt = scripted(tiny_bundle, text)
        await eng.start()
        evs = [ev async for ev in eng.submit(req(prompt, n=100))]
        await eng.stop()
        return evs

    evs = run(main())
    assert "".join(e.text for e in evs) == text
    assert all("\ufffd" not in e.text for e in evs)
    assert sum(e.text == "" for e in evs) > 0  # multi-byte characters were held until complete


def test_seeded_sampling_reproducible_and_batch_independent(tiny_bundle):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)

    async def main(with_others: bool):
        eng, _ = engine(tiny_bundle, slots=3)
        await eng.start()
        others = [eng.submit(req(p, n=12, sampling=SamplingParams(temperature=1.0))) for p in PROMPTS[:2]] \
            if with_others else []
        h = eng.submit(req(PROMPTS[3], n=12, sampling=sp))
        out = await h.result()
        await asyncio.gather(*(o.result() for o in others))
        await eng.stop()
        return out[1]

    a, b, c = run(main(False)), run(main(True)), run(main(True))
    assert a == b == c
    sp.seed = 99
    assert run(main(False)) != a


def test_prefix_reuse_hits_and_matches(tiny_bundle):
    system = list(range(20, 60))  # 40-token shared prefix

    async def main(prefix_cache: bool):
        eng, be = engine(tiny_bundle, slots=2, prefix_cache=prefix_cache, kv_block_size=8)
        await eng.start()
        be.calls.clear()  # drop the warm-up
        outs = [await eng.submit(req([1, *system, 70 + i], n=5)).result() for i in range(3)]
        both = await asyncio.gather(*(eng.submit(req([1, *system, 80 + i, 81], n=5)).result() for i in range(2)))
        st = eng.stats()
        await eng.stop()
        prefill_starts = [c[1][0] for c in be.calls if c[2][0] > 1]
        return [o[1] for o in outs + list(both)], st, prefill_starts

    ids_on, st_on, starts_on = run(main(True))
    ids_off, st_off, starts_off = run(main(False))
    assert ids_on == ids_off
    assert st_off.prefix_cache_hits == 0 and set(starts_off) == {0}
    assert st_on.prefix_cache_hits == 4 and st_on.prefix_cache_hit_tokens == 2 * 40 + 2 * 41  # no 1-token rest
    assert starts_on.count(0) == 1  # only the first prompt computed the shared prefix


def test_chunked_prefill_interleaves_with_decode(tiny_bundle):
    async def main():
        eng, be = engine(tiny_bundle, slots=3, prefill_chunk=16)
        eng.step_log = deque()
        be.pause(lambda b: decoding(b) and len(b.slots) == 2)  # both streams decoding, nothing else
        streams = [eng.submit(req(p, n=40)) for p in PROMPTS[:2]]  # both queued before the step thread runs
        await eng.start()
        await be.until_paused()
        eng.step_log.clear()
        long = eng.submit(req([1] + list(range(3, 100)), n=2))
        be.resume()
        await asyncio.gather(*(s.result() for s in streams), long.result())
        await eng.stop()
        return list(eng.step_log), long.metrics

    steps, m = run(main())
    prefill_steps = [s for s in steps if s[1] > 0]
    assert [p for _, p in prefill_steps] == [16] * 6 + [2]  # 98 tokens in chunks of 16
    assert all(d == 2 for d, _ in prefill_steps)  # both streams decoded in every prefill step


@pytest.mark.parametrize("slots", [1, 2])
def test_a_realtime_request_does_not_wait_for_a_batch_jobs_long_prefill(tiny_bundle, slots):
    """A batch job's 200-token prompt prefills 8 tokens a step (25 steps); a short realtime request that comes after
    its first chunk is admitted at once (in the free slot, or preempting the job) and its chunks come first in the
    step's budget: its first token comes before the job's. It waited for the job's whole prefill, free slot or not
    (admission saw no budget left beside the prefill under way, so it never even tried to preempt)."""
    long = [1] + [3 + i % 250 for i in range(199)]

    async def main():
        eng, be = engine(tiny_bundle, slots=slots, clock=FakeClock(), max_seq_len=256, prefill_chunk=8)
        await eng.start()
        be.pause(lambda b: int(b.past_lengths[0]) == 8)  # the job's second chunk waits until the request is in
        job = eng.submit(req(long, n=4, mode="batch"))
        await be.until_paused()
        rt = eng.submit(req(PROMPTS[3], n=4, priority="high"))
        be.resume()
        r_rt, r_job = await asyncio.gather(rt.result(), job.result())
        await eng.stop()
        return r_rt, r_job, rt.metrics, job.metrics

    r_rt, r_job, mr, mj = run(main())
    assert mr.first_token < mj.first_token
    assert r_rt[1] == run(alone(tiny_bundle, req(PROMPTS[3], n=4), max_seq_len=256))[1]
    assert r_job[1] == run(alone(tiny_bundle, req(long, n=4), max_seq_len=256))[1]


def test_preemption_resumes_batch_job_with_same_output(tiny_bundle):
    async def main():
        eng, be = engine(tiny_bundle, slots=1, clock=FakeClock(), step_s=0.003)
        await eng.start()
        be.pause(decoding)  # the job's first decode step waits
        job = eng.submit(req(PROMPTS[2], n=30, mode="batch"))
        await first_token(job)
        rt = eng.submit(req(PROMPTS[3], n=4, priority="high"))
        be.resume()  # the job decodes one more token, then the realtime request preempts it
        r_rt, r_job = await asyncio.gather(rt.result(), job.result())
        st = eng.stats()
        await eng.stop()
        return r_rt, r_job, job.metrics, rt.metrics, st

    r_rt, r_job, mj, mr, st = run(main())
    assert st.preemptions == 1 and mj.preemptions == 1
    assert mr.finished < mj.finished
    solo = run(alone(tiny_bundle, req(PROMPTS[2], n=30, mode="batch")))
    assert r_job[1] == solo[1] and r_job[0] == solo[0]


def test_submit_errors(tiny_bundle):
    async def main():
        eng, _ = engine(tiny_bundle, slots=1, max_waiting=2, max_seq_len=32)
        with pytest.raises(LinesideError, match="out of vocabulary"):
            eng.submit(req([1, 999]))
        with pytest.raises(LinesideError, match="context is 32"):
            eng.submit(req([1] * 40))
        with pytest.raises(LinesideError, match="priority"):
            eng.submit(req([1], priority="urgent"))
        with pytest.raises(LinesideError, match="temperature"):
            eng.submit(req([1], sampling=SamplingParams(temperature=-1)))
        hs = [eng.submit(req([1, 5])), eng.submit(req([1, 6])), eng.submit(req([1, 7]))]  # 1 slot, 2 waiting
        with pytest.raises(QueueFullError):
            eng.submit(req([1, 9]))
        await eng.start()
        await eng.stop(drain_timeout=5)
        with pytest.raises(EngineDraining):
            eng.submit(req([1, 8]))
        return [h.finish_reason for h in hs]

    assert run(main()) == ["length", "length", "length"]


@pytest.mark.parametrize("max_waiting", [0, 1])
def test_requests_that_free_slots_will_take_do_not_count_as_waiting(tiny_bundle, max_waiting):
    """The waiting-queue bound counts the requests beyond the free slots: a burst (or an n > 1 request) that the
    next step admits at once is not refused (with 4 free slots, --max-waiting 1 refused the third of a burst, and
    --max-waiting 0 every request, as "0 requests are already waiting")."""
    async def main():
        eng, _ = engine(tiny_bundle, slots=4, max_waiting=max_waiting)
        hs = [eng.submit(req([1, 5 + i])) for i in range(4 + max_waiting)]
        with pytest.raises(QueueFullError, match=f"{max_waiting} requests are already waiting"):
            eng.submit(req([1, 20]))
        await eng.start()
        outs = await asyncio.gather(*(h.result() for h in hs))
        await eng.stop()
        return [last.finish_reason for _, _, last in outs]

    assert run(main()) == ["length"] * (4 + max_waiting)


def test_the_waiting_bound_is_counted_under_the_state_lock(tiny_bundle):
    """The step thread moves requests from the incoming queue to the scheduler's under the state lock; a bound counted
    without it could see a request in neither (one too few: the bound passed by one) or in both (a wrong 429)."""
    import collections
    import threading

    async def main():
        eng, _ = engine(tiny_bundle, slots=1, max_waiting=1)
        unlocked = []

        class Watched(collections.deque):
            def __len__(self):
                if eng._state._owner != threading.get_ident():
                    unlocked.append("len")
                return super().__len__()

        eng._incoming = Watched()
        hs = [eng.submit(req([1, 5])), eng.submit(req([1, 6]))]
        with pytest.raises(QueueFullError):
            eng.submit(req([1, 7]))
        for h in hs:
            h.cancel()
        return unlocked

    assert run(main()) == []


def test_stop_cancels_what_does_not_drain(tiny_bundle):
    async def main():
        # 100 steps of 10 simulated ms, 1 real ms each: the 50 ms drain ends after ~5 of them.
        eng, _ = engine(tiny_bundle, slots=1, delay=0.001, clock=FakeClock(), step_s=0.01)
        await eng.start()
        h = eng.submit(req(PROMPTS[0], n=100))
        await first_token(h)
        await eng.stop(drain_timeout=0.05)
        return await h.result(), eng.ready

    (_, _, last), ready = run(main())
    assert last.finish_reason == "cancelled" and not ready


def test_stopped_engine_does_not_restart(tiny_bundle):
    async def main():
        eng, _ = engine(tiny_bundle, slots=1)
        await eng.start()
        await eng.stop()
        with pytest.raises(LinesideError, match="create a new LLMEngine"):
            await eng.start()

    run(main())


def test_backend_failure_fails_only_its_requests(tiny_bundle):
    async def main():
        eng, be = engine(tiny_bundle, slots=2)
        be.poison = 250
        await eng.start()
        good = eng.submit(req(PROMPTS[1], n=6))
        bad = eng.submit(req([1, 250, 3], n=6))
        rg, rb = await asyncio.gather(good.result(), bad.result())
        after = await eng.submit(req(PROMPTS[2], n=3)).result()
        st = eng.stats()
        await eng.stop()
        return rg[2], rb[2], after[2], st

    g, b, after, st = run(main())
    assert g.finish_reason == "length" and after.finish_reason == "length"
    assert b.finish_reason == "error" and b.error == "model step failed: fake device fault"
    assert st.requests == {"length": 2, "error": 1} and st.kv_blocks_reserved == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mix_keeps_every_invariant(tiny_bundle, seed):
    """Random arrivals, priorities, modes, seeds, cancels and tight KV: every request ends once, nothing leaks,
    and every request that ran to the end got exactly the tokens it gets alone (the fake's logits depend on
    the whole cache, so a wrong copy, move, reuse or replay shows)."""
    import random

    rnd = random.Random(seed)
    base = list(range(20, 44))
    specs = []
    for i in range(24):
        prompt = [1, *base[:rnd.choice([0, 8, 16, 24])], *[rnd.randrange(3, 259) for _ in range(rnd.randrange(1, 12))]]
        sp = SamplingParams(temperature=rnd.choice([0.0, 0.8]), seed=rnd.randrange(1000))
        specs.append(dict(prompt_ids=prompt, max_tokens=rnd.randrange(1, 20), sampling=sp,
                          priority=rnd.choice(["high", "normal", "low"]), mode=rnd.choice(["realtime", "batch"]),
                          request_id=f"r{i}"))
    cancel_after = {f"r{i}": rnd.randrange(0, 4) for i in rnd.sample(range(24), 5)}
    arrivals = [rnd.randrange(0, 200) for _ in specs]

    async def main():
        eng, be = engine(tiny_bundle, slots=3, prefill_chunk=5, kv_block_size=4, kv_blocks=20, aging_s=0.02,
                         clock=FakeClock(), step_s=0.001)
        await eng.start()

        outs = await asyncio.gather(*(submit_after(eng, s, y, cancel_after)
                                       for s, y in zip(specs, arrivals, strict=True)))
        st = eng.stats()
        await eng.stop()
        return outs, st

    outs, st = run(main())
    assert st.running == st.waiting == 0 and st.kv_blocks_reserved == 0
    assert sum(st.requests.values()) == 24 and st.prefix_cache_hits > 0
    for spec, (ids, last) in zip(specs, outs, strict=True):
        if last.finish_reason in ("length", "stop"):
            solo = run(alone(tiny_bundle, GenerationRequest(**spec)))
            assert ids == solo[1], spec["request_id"]
        else:
            assert last.finish_reason == "cancelled"


def test_a_row_of_nan_logits_fails_only_its_request(tiny_bundle):
    """A model row that is all NaN (a numerical failure in one sequence) ends that request with a one-line error;
    the request decoding beside it in the same batch goes on."""
    async def main():
        eng, be = engine(tiny_bundle, slots=2)
        plain = be.logits
        be.logits = lambda seq: np.full(be.vocab_size, np.nan, np.float32) if 251 in seq and len(seq) > 4 \
            else plain(seq)
        await eng.start()
        good = eng.submit(req(PROMPTS[1], n=6))
        bad = eng.submit(req([1, 251, 3], n=6))
        rg, rb = await asyncio.gather(good.result(), bad.result())
        await eng.stop()
        return rg[2], rb[2]

    g, b = run(main())
    assert g.finish_reason == "length"
    assert b.finish_reason == "error" and "NaN" in b.error and "\n" not in b.error
