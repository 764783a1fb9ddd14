"""The in-process API misused the way application code does: each misuse ends in one LinesideError, never a hang,
a second step thread, a leaked thread or silently wrong output. Interleavings are forced, never waited for."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from lineside.errors import LinesideError
from lineside.runtime.engine import LLMEngine
from lineside.runtime.generate import Generator
from lineside.runtime.request import GenerationRequest
from lineside.runtime.sampling import SamplingParams
from tests.runtime.conftest import run
from tests.runtime.fakes import FakeBackend


def engine(bundle, slots=1, **kw) -> LLMEngine:
    return LLMEngine(bundle, backend=FakeBackend(slots, max_seq_len=kw.pop("max_seq_len", 64)),
                     clock=time.monotonic, **kw)


def req(prompt, n=4, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_tokens=n, **kw)


def step_threads(eng: LLMEngine) -> int:
    return sum(t.name == "lineside-step" and t.is_alive() for t in threading.enumerate())


def test_two_concurrent_starts_run_one_step_thread(tiny_bundle):
    """Both start() calls passed the `_thread is None` check before the warm-up's await: two step threads ran the
    same scheduler and backend at once."""

    async def main():
        eng = engine(tiny_bundle)
        before = step_threads(eng)
        await asyncio.gather(eng.start(), eng.start())
        n = step_threads(eng) - before
        out = await eng.submit(req([1, 5, 6])).result()
        await eng.stop()
        return n, out[2].finish_reason

    assert run(main()) == (1, "length")


def test_submit_from_another_event_loop_is_refused(tiny_bundle):
    """Started under one asyncio.run and used under the next: the events went to the first (closed) loop and
    the request's result() waited forever."""
    eng = engine(tiny_bundle)
    asyncio.run(eng.start())

    async def later():
        with pytest.raises(LinesideError, match="loop this engine was started on has closed"):
            eng.submit(req([1, 5, 6]))

    run(later())
    eng.close()


def test_handle_read_on_another_loop_is_refused(tiny_bundle):
    """A handle submitted on the engine's loop (from another thread) and read under a loop of the caller's own:
    the engine's loop filled a queue the other loop waited on, unsafely across threads."""

    async def main():
        eng = engine(tiny_bundle)
        await eng.start()
        h = eng.submit(req([1, 5, 6]))

        def elsewhere():
            with pytest.raises(LinesideError, match="another event loop"):
                asyncio.run(h.result())

        await asyncio.to_thread(elsewhere)
        out = await h.result()  # still whole on its own loop
        await eng.stop()
        return out[2].finish_reason

    assert run(main()) == "length"


def test_step_thread_ends_when_its_loop_closes_without_stop(tiny_bundle):
    """An engine never stopped, its loop gone: the step thread idled for the life of the process (keeping the
    engine and its backend alive). Now it ends at its next look (here a kick, else a bounded idle wait)."""
    eng = engine(tiny_bundle)
    asyncio.run(eng.start())
    thread = eng._thread
    assert thread is not None and thread.is_alive()
    eng._kick()
    thread.join(30)
    assert not thread.is_alive() and eng.draining


def test_a_consumed_handle_says_so(tiny_bundle):
    """A second `async for` over a finished handle ended at once, as if the request had produced nothing."""

    async def main():
        eng = engine(tiny_bundle)
        await eng.start()
        h = eng.submit(req([1, 5, 6]))
        events = [ev async for ev in h]
        h.cancel()  # after the finish: a no-op
        with pytest.raises(LinesideError, match="already consumed"):
            [ev async for ev in h]
        with pytest.raises(LinesideError, match="already consumed"):
            await h.result()
        await eng.stop()
        await eng.stop()  # twice: a no-op
        return events[-1].finish_reason

    assert run(main()) == "length"


@pytest.mark.parametrize(("prompt", "match"), [
    ([1, 5.7], "token ids must be integers, got 5.7"),  # was token 5: another prompt than the one given
    ([1, "5"], "token ids must be integers, got '5'"),
    ([1, True], "token ids must be integers, got True"),
    (np.array([], dtype=np.int64), "prompt is empty"),  # was numpy's "truth value ... is ambiguous" for longer ones
    ([1, -3], "token id -3 is out of vocabulary"),
])
def test_prompt_ids_that_are_not_token_ids(tiny_bundle, prompt, match):
    with pytest.raises(LinesideError, match=match):
        engine(tiny_bundle).submit(GenerationRequest(prompt_ids=prompt))


def test_numpy_prompt_ids_are_taken_as_plain_ints(tiny_bundle):
    async def main():
        eng = engine(tiny_bundle)
        await eng.start()
        a = await eng.submit(GenerationRequest(prompt_ids=np.array([1, 5, 6]), max_tokens=4)).result()
        b = await eng.submit(req([1, 5, 6])).result()
        await eng.stop()
        return a[1], b[1]

    a, b = run(main())
    assert a == b and len(a) == 4


@pytest.mark.parametrize(("params", "match"), [
    (dict(repetition_penalty=math.nan), "repetition_penalty must be a finite number"),  # all three sampled on
    (dict(presence_penalty=math.nan), "presence_penalty must be a finite number"),
    (dict(frequency_penalty=math.inf), "frequency_penalty must be a finite number"),
    (dict(temperature=math.inf, seed=1), "temperature must be a finite number"),  # failed at the step: NaN probs
    (dict(temperature="1"), "temperature must be a finite number"),  # TypeError
    (dict(top_k=2.5, temperature=1.0), "top_k must be an integer"),  # failed at the step
    (dict(seed="x"), "seed must be an integer"),  # TypeError
    (dict(seed=-1), "seed must be ≥ 0"),  # numpy's ValueError
])
def test_sampling_params_that_are_not_numbers(tiny_bundle, params, match):
    with pytest.raises(LinesideError, match=match):
        engine(tiny_bundle).submit(req([1, 5, 6], sampling=SamplingParams(**params)))


@pytest.mark.parametrize(("kw", "match"), [
    (dict(max_tokens=2.5), "max_tokens must be an integer"),  # generated 3 tokens
    (dict(max_tokens="3"), "max_tokens must be an integer"),  # TypeError
    (dict(timeout_s="1"), "timeout must be > 0"),  # TypeError
])
def test_request_fields_of_the_wrong_type(tiny_bundle, kw, match):
    with pytest.raises(LinesideError, match=match):
        engine(tiny_bundle).submit(GenerationRequest(prompt_ids=[1, 5, 6], **kw))


def generator(bundle, max_seq_len=64) -> Generator:
    return Generator(bundle, backend=FakeBackend(1, max_seq_len=max_seq_len))


def test_generator_interleaved_streams_raise_instead_of_mixing_caches(tiny_bundle):
    """Two streams of one Generator (two threads, or one thread alternating) shared slot 0: the earlier one went
    on decoding on the later one's cache and yielded another prompt's continuation, silently."""
    g = generator(tiny_bundle)
    ref_b = list(g.stream([1, 7, 7], 8))
    a, b = g.stream([1, 5, 6], 8), g.stream([1, 7, 7], 8)
    next(a)
    assert list(b) == ref_b  # the later stream is whole
    with pytest.raises(LinesideError, match="another stream started on this Generator"):
        next(a)


def test_generator_after_an_abandoned_or_interrupted_stream(tiny_bundle):
    g = generator(tiny_bundle)
    ref = g.generate("ab", max_tokens=6)
    s = g.stream([1, 9, 9], 8)
    next(s)  # abandoned midway
    assert g.generate("ab", max_tokens=6) == ref
    try:
        for _ in g.stream([1, 9, 9], 8):
            raise KeyboardInterrupt  # Ctrl-C in the caller's loop
    except KeyboardInterrupt:
        pass
    assert g.generate("ab", max_tokens=6) == ref


def test_generator_cut_at_the_context_is_a_length_finish(tiny_bundle):
    """max_tokens beyond the context: the stream stopped at the context and generate() reported "stop" (EOS)."""
    g = generator(tiny_bundle, max_seq_len=16)
    r = g.generate("ab", max_tokens=100)
    assert len(r.token_ids) == 16 - r.prompt_tokens and r.finish_reason == "length"
    with pytest.raises(LinesideError, match="max_tokens must be an integer ≥ 1"):
        list(g.stream([1, 5], 0))
