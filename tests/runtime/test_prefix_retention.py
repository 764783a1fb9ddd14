"""The prefix cache keeps recently used prefixes while free slots can hold them (vLLM's prefix cache is LRU over all
free blocks): a request that reuses nothing takes the least valuable free slot, and the decode batch of a backend
that needs contiguous slots stays where it is instead of moving to slot 0 over someone's cached prompt."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.runtime.backend import StepBatch
from lineside.runtime.engine import LLMEngine
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.request import GenerationRequest
from tests.runtime.conftest import run
from tests.runtime.fakes import FakeBackend

RNG = np.random.default_rng(7)
SYSTEM = [RNG.integers(3, 259, 40).tolist() for _ in range(3)]  # three 40-token system prompts
UNRELATED = RNG.integers(3, 259, 30).tolist()


def ask(prefix: list[int], i: int) -> list[int]:
    return [1, *prefix, 200 + i, 201 + i, 202 + i]


async def one_at_a_time(eng: LLMEngine, prompts: list[list[int]], n: list[int] | None = None,
                        ) -> tuple[list[list[int]], list[int]]:
    """Each prompt after the one before has finished: (token ids, prefix_reused_tokens) per request."""
    await eng.start()
    ids, cached = [], []
    for i, p in enumerate(prompts):
        h = eng.submit(GenerationRequest(p, max_tokens=6 if n is None else n[i]))
        ids.append((await h.result())[1])
        cached.append(h.metrics.prefix_reused_tokens)
    await eng.stop()
    return ids, cached


def make(bundle, backend: str, **kw) -> LLMEngine:
    if backend == "fake-any-slots":  # TensorRT's kind: the decode batch may sit in any slots
        be = FakeBackend(4, max_seq_len=128)
        be.needs_contiguous_slots = False
        return LLMEngine(bundle, backend=be, kv_block_size=4, **kw)
    return LLMEngine(bundle, backend="onnxruntime", threads=2, num_slots=4, kv_block_size=4, **kw)


@pytest.mark.parametrize("backend", ["onnxruntime", "fake-any-slots"])
def test_a_prefix_survives_an_unrelated_request(tiny_bundle, backend):
    """S+q1, then U, then S+q2 one at a time with 4 slots: every request used to land in slot 0 (the lowest free one),
    so U overwrote S and S+q2 recomputed all of it."""
    prompts = [ask(SYSTEM[0], 0), [1, *UNRELATED], ask(SYSTEM[0], 1)]
    ids, cached = run(one_at_a_time(make(tiny_bundle, backend), prompts))
    assert cached[2] >= 1 + len(SYSTEM[0])
    want, _ = run(one_at_a_time(make(tiny_bundle, backend, prefix_cache=False), prompts))
    assert ids == want


def test_n_minus_one_prefixes_survive_interleaving(tiny_bundle):
    """With 4 slots, three system prompts asked in turn (and an unrelated request now and then) each reuse theirs
    from the second round on; the least recently used goes first when a fourth prefix needs a slot."""
    rounds = [ask(SYSTEM[k], r) for r in range(3) for k in range(3)]
    prompts = [*rounds[:3], [1, *UNRELATED], *rounds[3:6], [1, *UNRELATED[::-1]], *rounds[6:]]
    ids, cached = run(one_at_a_time(make(tiny_bundle, "onnxruntime"), prompts))
    later = [c for p, c in zip(prompts[4:], cached[4:], strict=True) if p[1:41] in SYSTEM]
    assert len(later) == 6 and all(c >= 41 for c in later), cached
    want, _ = run(one_at_a_time(make(tiny_bundle, "onnxruntime", prefix_cache=False), prompts))
    assert ids == want


def test_a_decode_batch_away_from_slot_0_gives_the_same_logits(tiny_bundle):
    """The onnxruntime fast path binds the decode batch at any first slot: rows in slots 2..3 decode exactly as in
    0..1 (the scheduler now leaves a batch where it is)."""
    be = OnnxRuntimeBackend(open_bundle(tiny_bundle), num_slots=4, threads=2)
    prompts = [RNG.integers(3, 259, 9).tolist(), RNG.integers(3, 259, 9).tolist()]

    def decode_at(first: int) -> list[np.ndarray]:
        nxt = []
        for r, p in enumerate(prompts):
            nxt.append(int(be.forward(StepBatch.single(first + r, p, 0))[0, -1].argmax()))
        out, past = [], len(prompts[0])
        for _ in range(4):
            batch = StepBatch(slots=[first, first + 1], input_ids=np.array(nxt, np.int64).reshape(2, 1),
                              past_lengths=np.array([past, past], np.int64), new_lengths=np.ones(2, np.int64),
                              logits_positions=np.zeros((2, 1), np.int64))
            logits = be.forward(batch)
            out.append(logits.copy())
            nxt, past = logits[:, 0].argmax(-1).tolist(), past + 1
        return out

    at0, at2 = decode_at(0), decode_at(2)
    assert all(np.array_equal(a, b) for a, b in zip(at0, at2, strict=True))


def test_concurrent_requests_still_decode_in_one_range(tiny_bundle):
    """Requests arriving while others decode take slots beside the batch or are moved next to it: every decode step
    is one range of slots, and the outputs are those of one at a time."""
    prompts = [ask(SYSTEM[i % 3], i) for i in range(6)] + [[1, *UNRELATED]]

    async def main():
        be = FakeBackend(4, max_seq_len=128)
        eng = LLMEngine(tiny_bundle, backend=be, kv_block_size=4, prefill_chunk=16)
        await eng.start()
        hs = []
        for i, p in enumerate(prompts):
            hs.append(eng.submit(GenerationRequest(p, max_tokens=3 + 2 * i)))
            await asyncio.sleep(0)
        outs = [(await h.result())[1] for h in hs]
        await eng.stop()
        return outs, be.calls

    outs, calls = run(main())
    decodes = [slots for slots, _, new in calls if max(new) == 1]
    assert decodes and all(s == list(range(s[0], s[0] + len(s))) for s in decodes)
    solo, _ = run(one_at_a_time(make(tiny_bundle, "fake-any-slots", prefix_cache=False), prompts,
                                [3 + 2 * i for i in range(len(prompts))]))
    assert outs == solo


async def chat_turns(eng: LLMEngine, first: list[int], news: list[list[int]], n: int,
                     settle: bool = True) -> tuple[list[list[int]], list[int]]:
    """A chat: each turn's prompt is the one before + its answer's ids + a new message; waits (event-loop turns, no
    clock) until the engine has settled the answer before the next turn, as a user reading it gives it time to."""
    await eng.start()
    ids, cached, prompt = [], [], list(first)
    for new in [[], *news]:
        prompt = [*prompt, *(ids[-1] if ids else []), *new]
        h = eng.submit(GenerationRequest(prompt, max_tokens=n))
        ids.append((await h.result())[1])
        cached.append(h.metrics.prefix_reused_tokens)
        for _ in range(2_000_000 if settle else 0):  # bounded: an engine that never settles fails, never hangs
            if eng.arena.next_unsettled() is None:
                break
            await asyncio.sleep(0)
    await eng.stop()
    return ids, cached


@pytest.mark.parametrize("backend", ["onnxruntime", "fake-any-slots"])
def test_a_chats_next_turn_reuses_the_answer_too(tiny_bundle, backend):
    """Turn N reuses turn N-1's prompt and all of its answer's ids (the last one's too, whose KV no decode step wrote),
    as vLLM's prefix cache does; it used to reuse the prompt only (an answer's KV came from decode steps). The
    answers equal a fresh engine's without any prefix cache."""
    first = [1, *SYSTEM[1], 210, 211]
    news = [[220 + i, 221 + i, 222 + i] for i in range(3)]
    ids, cached = run(chat_turns(make(tiny_bundle, backend), first, news, n=7))
    lens = [len(first)]
    for turn, new in zip(ids, news, strict=False):
        lens.append(lens[-1] + len(turn) + len(new))
    assert cached[1:] == [lens[k + 1] - len(news[k]) for k in range(3)], (cached, lens)
    want, _ = run(chat_turns(make(tiny_bundle, backend, prefix_cache=False), first, news, n=7, settle=False))
    assert ids == want


def test_an_answer_not_to_be_continued_is_not_recomputed(tiny_bundle):
    """settle_answer=False (a one-off completion, request_mapping) spares the idle recompute of its answer: nothing
    is left to settle, and the next request reuses the prompt alone."""
    async def main():
        eng = make(tiny_bundle, "fake-any-slots")
        await eng.start()
        prompt = [1, *SYSTEM[1], 210, 211]
        ids = (await eng.submit(GenerationRequest(prompt, max_tokens=7, settle_answer=False)).result())[1]
        pending = eng.arena.next_unsettled()
        h = eng.submit(GenerationRequest([*prompt, *ids, 230], max_tokens=2))
        await h.result()
        await eng.stop()
        return pending, h.metrics.prefix_reused_tokens, len(prompt)

    pending, reused, prompt_len = run(main())
    assert pending is None and reused <= prompt_len
