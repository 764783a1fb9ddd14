"""Seeded random mixes of requests on a real engine, each answer checked against the same request run alone on a
fresh engine (the README's promise: greedy answers do not depend on batching, chunking, prefix caching, sessions
or speculation). tests/runtime/test_consistency_mix.py runs a few small mixes on the tiny fp32 bundle; by hand,
on the demo bundle (longer):

    PYTHONPATH=$PWD python -m tests.runtime.consistency_mix BUNDLE --mixes 20 --seed 1

A mix draws an engine (slots, prefill chunk, KV block size, speculative ngram or not) and 4-10 requests: prompt
lengths of 1 token, at a block or chunk boundary, one past it, near the context (down to one token short of it);
prompts sharing a random prefix of another; arrivals at random delays; cancellation after a random number of
streamed tokens; stop strings taken from the request's own answer; max_tokens 1, or what the context leaves (the
server's default: the answer ends with "length" exactly at the context); n > 1 as the server makes it (copies
sampling with seed + j); logprobs; a prefill session used by the request or left abandoned (released or not).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from lineside.runtime.engine import LLMEngine
from lineside.runtime.request import GenerationRequest, Mode, Priority
from lineside.runtime.sampling import SamplingParams
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig


@dataclass(frozen=True)
class EngineSetup:
    num_slots: int
    prefill_chunk: int
    kv_block_size: int
    speculative: bool
    kv_blocks: int | None = None  # None: every slot's full context; fewer: running requests get preempted

    def engine(self, bundle, threads: int = 2) -> LLMEngine:
        spec = SpeculativeConfig(SpecMethod.NGRAM, num_tokens=4) if self.speculative else None
        return LLMEngine(bundle, backend="onnxruntime", threads=threads, num_slots=self.num_slots,
                         prefill_chunk=self.prefill_chunk, kv_block_size=self.kv_block_size, speculative=spec,
                         kv_blocks=self.kv_blocks)


@dataclass
class Ask:
    """One request of a mix and what the harness does around it."""

    name: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    stop_from_answer: bool = False  # stop at a piece of the request's own answer (found by a solo run first)
    stop: list[str] = field(default_factory=list)
    delay_s: float = 0.0  # arrival after the mix starts
    cancel_after: int | None = None  # cancel once this many tokens have streamed
    session: str | None = None  # prefill this session with the prompt (stable = session_stable) before submitting
    session_stable: int = 0
    use_session: bool = True  # False: the session is made and abandoned, the request sends its prompt plainly
    release_session: bool = False  # abandoned sessions: released at once (else left to hold their slot)
    priority: Priority = Priority.NORMAL  # a later high-priority arrival preempts running batch-mode requests
    mode: Mode = Mode.REALTIME

    def request(self, rid: str) -> GenerationRequest:
        sp = SamplingParams(temperature=self.temperature, seed=self.seed, repetition_penalty=self.repetition_penalty,
                            presence_penalty=self.presence_penalty)
        return GenerationRequest(prompt_ids=list(self.prompt), max_tokens=self.max_tokens, sampling=sp,
                                 stop=list(self.stop), logprobs=self.logprobs, request_id=rid,
                                 priority=self.priority, mode=self.mode,
                                 session_id=self.session if (self.session and self.use_session) else None)


@dataclass
class Answer:
    text: str
    ids: list[int]
    finish: str
    logprobs: list[float]

    def describe(self) -> str:
        return f"{self.finish} {self.ids} {self.text!r}"


def draw_mix(rng: random.Random, vocab: int, ctx: int, long_ok: bool = True,
             speculative: bool | None = None) -> tuple[EngineSetup, list[Ask]]:
    """An engine setup and its requests, all from ``rng`` (speculative None: drawn too)."""
    setup = EngineSetup(num_slots=rng.choice([1, 2, 2, 3, 4]), prefill_chunk=rng.choice([4, 8, 16, 32, 512]),
                        kv_block_size=rng.choice([4, 8, 16]), speculative=rng.random() < 0.5)
    if speculative is not None:
        setup = replace(setup, speculative=speculative)
    edges = [1, setup.kv_block_size, setup.kv_block_size + 1, setup.prefill_chunk, setup.prefill_chunk + 1,
             2 * setup.kv_block_size, 2 * setup.prefill_chunk + 1]
    edges = [e for e in edges if e < ctx - 1]

    def tokens(k: int) -> list[int]:
        # a small alphabet in part of the prompts: repeats give the ngram proposer something to copy
        hi = rng.choice([vocab - 1, 40])
        return [rng.randrange(3, hi) for _ in range(k)]

    asks: list[Ask] = []
    n = rng.randint(4, 10)
    for i in range(n):
        kind = rng.random()
        if asks and kind < 0.35:  # shares a random-length prefix of an earlier prompt (on or off a block edge)
            base = rng.choice(asks).prompt
            cut = rng.choice([rng.randint(1, len(base)), min(len(base), setup.kv_block_size),
                              len(base) // setup.kv_block_size * setup.kv_block_size or 1, len(base)])
            prompt = base[:cut] + tokens(rng.choice([0, 1, rng.randint(1, 20)]))
        elif long_ok and kind < 0.45:  # near the context limit, down to one token short of it
            prompt = tokens(ctx - rng.choice([1, 2, rng.randint(2, 12)]))
        else:
            prompt = tokens(rng.choice(edges + [rng.randint(1, min(80, ctx - 2))]))
        prompt = prompt[:ctx - 1] or tokens(1)
        room = ctx - len(prompt)  # what the server asks for when a request sends no max_tokens
        max_tokens = rng.choice([1, 1, rng.randint(2, 8), rng.randint(8, 24), room if room <= 32 else 24])
        ask = Ask(f"r{i}", prompt, max_tokens, delay_s=rng.choice([0.0, 0.0, rng.uniform(0, 0.05)]))
        if rng.random() < 0.2:
            ask.mode = Mode.BATCH
        elif ask.delay_s and rng.random() < 0.4:
            ask.priority = Priority.HIGH
        if rng.random() < 0.15:
            ask.repetition_penalty, ask.presence_penalty = rng.choice([(1.3, 0.0), (1.0, 1.5), (1.2, 0.5)])
        if rng.random() < 0.25:
            ask.logprobs = rng.choice([0, 3])
        if rng.random() < 0.2:
            ask.stop_from_answer = True
        if rng.random() < 0.15:
            ask.cancel_after = rng.randint(0, 3)
        if rng.random() < 0.2 and len(prompt) > 2:
            ask.session = f"s{i}"
            ask.session_stable = rng.randint(1, len(prompt))
            ask.use_session = rng.random() < 0.6
            ask.release_session = not ask.use_session and rng.random() < 0.5
        if rng.random() < 0.15:  # n > 1: copies sampling with seed + j, as request_mapping makes them
            seed = rng.randrange(2**32)
            temp = rng.choice([0.0, 0.8])
            for j in range(rng.randint(2, 3)):
                asks.append(replace(ask, name=f"r{i}.{j}", temperature=temp, seed=seed + j, session=None))
            continue
        asks.append(ask)
    if rng.random() < 0.3:  # a tight arena: room for the largest request and a little more, so others preempt
        need = max(-(-(len(a.prompt) + a.max_tokens) // setup.kv_block_size) for a in asks)
        setup = replace(setup, kv_blocks=need + rng.randint(0, 4))
    return setup, asks


async def _collect(handle, cancel_after: int | None) -> Answer:
    text, ids, lps, last = [], [], [], None
    async for ev in handle:
        text.append(ev.text)
        ids.extend(ev.token_ids)
        lps.extend(lp.logprob for lp in ev.logprobs)
        last = ev
        if cancel_after is not None and len(ids) >= cancel_after and ev.finish_reason is None:
            handle.cancel()
    assert last is not None
    return Answer("".join(text), ids, str(last.finish_reason), lps)


async def _pending(eng: LLMEngine, sid: str) -> None:
    """Until the session's prompt is in its KV: the engine announces it by no event, so its state is read again
    after each yield (a bound of 60 s of them, never a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while (info := eng.session(sid)) is not None and info.pending_tokens:
        assert loop.time() < deadline, f"session {sid} never finished its prefill"
        await asyncio.sleep(0.001)


COUNTED = ("preemptions", "prefix_cache_hits", "session_hits", "sessions_evicted", "spec_draft_tokens_total",
           "spec_accepted_tokens_total")


async def run_mix(bundle, setup: EngineSetup, asks: list[Ask],
                  counts: dict[str, int] | None = None) -> dict[str, Answer]:
    """Every ask on one engine, arriving at its delay; sessions prefilled (and for some awaited) before. ``counts``
    adds up the engine's counters of COUNTED (what the mix exercised)."""
    eng = setup.engine(bundle)
    await eng.start()

    async def one(a: Ask) -> Answer:
        await asyncio.sleep(a.delay_s)
        if a.session:
            eng.prefill(a.session, a.prompt, a.session_stable)
            if a.use_session and a.delay_s:
                await _pending(eng, a.session)
            if a.release_session:
                eng.release_session(a.session)
        return await _collect(eng.submit(a.request(a.name)), a.cancel_after)

    try:
        outs = await asyncio.gather(*(one(a) for a in asks))
        if counts is not None:
            st = eng.stats()
            for k in COUNTED:
                counts[k] = counts.get(k, 0) + int(getattr(st, k))
    finally:
        await eng.stop()
    return {a.name: o for a, o in zip(asks, outs, strict=True)}


async def run_alone(bundle, ask: Ask) -> Answer:
    """The request alone on a fresh engine: one slot, no prefix cache to hit, no speculation, no session."""
    eng = EngineSetup(1, 512, 16, False).engine(bundle)
    await eng.start()
    try:
        return await _collect(eng.submit(replace(ask, session=None).request(ask.name + "-alone")), None)
    finally:
        await eng.stop()


def stop_string(rng: random.Random, answer: Answer) -> list[str]:
    """A piece of the answer's text (1-3 characters from a random place), or a string it never holds."""
    t = answer.text
    if len(t) < 2:
        return ["\x00never"]
    i = rng.randrange(1, len(t))
    return [t[i:i + rng.randint(1, 3)]]


def compare(ask: Ask, got: Answer, want: Answer, lp_tol: float) -> str | None:
    """None when ``got`` is what running alone gives (a cancelled one: a prefix of it), else why not."""
    if ask.cancel_after is not None and got.finish == "cancelled":
        ok = want.ids[:len(got.ids)] == got.ids and want.text.startswith(got.text)
    else:
        ok = got.ids == want.ids and got.text == want.text and got.finish == want.finish
    if ok and got.logprobs and want.logprobs:
        k = min(len(got.logprobs), len(want.logprobs))
        ok = bool(np.allclose(got.logprobs[:k], want.logprobs[:k], rtol=0, atol=lp_tol))
    if ok:
        return None
    return f"{ask.name} ({len(ask.prompt)}-token prompt, {ask}):\n  mix:   {got.describe()}\n  alone: {want.describe()}"


async def check_mix(bundle, rng: random.Random, vocab: int, ctx: int, lp_tol: float = 1e-4,
                    long_ok: bool = True, speculative: bool | None = None,
                    counts: dict[str, int] | None = None) -> tuple[EngineSetup, list[Ask], list[str]]:
    """Draw a mix, run it and each request alone; the differences found (empty: every answer as alone)."""
    setup, asks = draw_mix(rng, vocab, ctx, long_ok, speculative)
    for a in asks:
        if a.stop_from_answer:
            a.stop = stop_string(rng, await run_alone(bundle, a))
    got = await run_mix(bundle, setup, asks, counts)
    diffs = []
    for a in asks:
        why = compare(a, got[a.name], await run_alone(bundle, a), lp_tol)
        if why:
            diffs.append(why)
    return setup, asks, diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--mixes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ctx", type=int, default=0, help="context to draw prompts within (0: the bundle's)")
    p.add_argument("--logprob-tol", type=float, default=1e-3)
    p.add_argument("--speculative", choices=["drawn", "on", "off"], default="drawn")
    args = p.parse_args(argv)
    from lineside.bundle import open_bundle

    bundle = open_bundle(args.bundle)
    ctx = args.ctx or bundle.manifest.max_seq_len
    vocab = bundle.config.vocab_size
    total, failed, counts = 0, 0, {}
    for m in range(args.mixes):
        rng = random.Random(args.seed * 100_003 + m)
        setup, asks, diffs = asyncio.run(check_mix(bundle, rng, vocab, ctx, args.logprob_tol, True,
                                                       {"drawn": None, "on": True, "off": False}[args.speculative],
                                                       counts))
        total += len(asks)
        failed += len(diffs)
        print(f"mix {m}: {setup}, {len(asks)} requests, {len(diffs)} differ", flush=True)
        for d in diffs:
            print("  " + d, flush=True)
    print(f"{args.mixes} mixes, {total} requests, {failed} differ; engines counted {counts}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
