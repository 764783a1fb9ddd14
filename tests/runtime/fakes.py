"""A deterministic stand-in backend: logits depend on every token in the slot's cache, so any KV mix-up
(wrong copy, wrong slot, wrong past length) changes the output; scripted prompts emit fixed tokens.
And a fake clock for the engine, so aging, admission and timeout rules run on simulated time."""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np

from lineside.runtime.backend import StepBatch


class FakeClock:
    """The engine's injected clock. Each read moves it on by ``tick`` (so no two events share a time and
    their order shows in the timestamps); ``advance`` is time passing (a FakeBackend step, a test's wait)."""

    def __init__(self, start: float = 1000.0, tick: float = 1e-6):
        self.now, self.tick = start, tick
        self._lock = threading.Lock()  # read on the event loop, advanced from the engine's worker thread

    def __call__(self) -> float:
        with self._lock:
            t = self.now
            self.now += self.tick
            return t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class FakeBackend:
    name = "fake"
    flavor = "cpu"
    needs_contiguous_slots = True  # as the cpu graph: the engine tests check the decode batch stays one range

    def __init__(self, num_slots: int, max_seq_len: int = 128, vocab_size: int = 300, text_ids: int = 259,
                 eos: int = 2, delay: float = 0.0, clock: FakeClock | None = None, step_s: float = 0.0):
        self.num_slots, self.max_seq_len, self.vocab_size = num_slots, max_seq_len, vocab_size
        self.kv = np.full((num_slots, max_seq_len), -1, dtype=np.int64)
        self.text_ids, self.eos, self.delay = text_ids, eos, delay  # delay: real seconds slept per forward
        self.clock, self.step_s = clock, step_s  # step_s: simulated seconds each forward takes on ``clock``
        self.scripts: dict[tuple[int, ...], list[int]] = {}
        self.calls: list[tuple[list[int], list[int], list[int]]] = []  # (slots, past, new) per forward
        self.poison: int | None = None  # a token whose presence in a step's input makes forward raise
        self.broken: Exception | None = None  # while set, every forward raises it (a device that died)
        # The engine steps in a thread of its own: a test holds it at a chosen forward (``pause``) to act between
        # two steps, then lets it go on (``resume``).
        self._pause_when: Callable[[StepBatch], bool] | None = None
        self._pause_lock = threading.Lock()
        self._gate = threading.Event()
        self.paused = threading.Event()  # a forward is waiting for ``resume``

    def pause(self, when: Callable[[StepBatch], bool]) -> None:
        """The next forward whose batch ``when`` accepts waits (before it runs) until ``resume``."""
        with self._pause_lock:
            self._pause_when = when

    async def until_paused(self) -> None:
        """Until a forward waits (the engine stands between two steps): waited for off the event loop."""
        assert await asyncio.to_thread(self.paused.wait, 60), "no forward reached the pause"

    def resume(self, then: Callable[[StepBatch], bool] | None = None) -> None:
        """Let a waiting forward go (or stop waiting for one); with ``then``, the next forward it accepts waits."""
        with self._pause_lock:
            self._pause_when = then
            self.paused.clear()
            gate, self._gate = self._gate, threading.Event()
        gate.set()

    def forward(self, batch: StepBatch) -> np.ndarray:
        with self._pause_lock:
            when = self._pause_when
            gate = self._gate if when is not None and when(batch) else None
            if gate is not None:
                self.paused.set()
        if gate is not None:
            gate.wait(timeout=60)
        if self.delay:
            time.sleep(self.delay)
        if self.clock is not None:
            self.clock.advance(self.step_s)
        self.calls.append((list(batch.slots), batch.past_lengths.tolist(), batch.new_lengths.tolist()))
        if self.poison is not None and (batch.input_ids == self.poison).any():
            raise RuntimeError("fake device fault\nsecond line")
        if self.broken is not None:
            raise self.broken
        out = np.zeros((len(batch.slots), batch.logits_positions.shape[1], self.vocab_size), dtype=np.float32)
        for r, slot in enumerate(batch.slots):
            p, n = int(batch.past_lengths[r]), int(batch.new_lengths[r])
            assert p + n <= self.max_seq_len
            assert (self.kv[slot, :p] >= 0).all(), "engine attended to positions it never wrote"
            self.kv[slot, p:p + n] = batch.input_ids[r, :n]
            self.kv[slot, p + n:] = -1
            for k, pos in enumerate(batch.logits_positions[r]):
                out[r, k] = self.logits(self.kv[slot, :p + int(pos) + 1].tolist())
        return out

    def logits(self, seq: list[int]) -> np.ndarray:
        for prompt, script in self.scripts.items():
            if tuple(seq[:len(prompt)]) == prompt and len(seq) >= len(prompt):
                i = len(seq) - len(prompt)
                x = np.full(self.vocab_size, -10.0, dtype=np.float32)
                x[script[i] if i < len(script) else self.eos] = 10.0
                return x
        h = zlib.crc32(np.asarray(seq, dtype=np.int64).tobytes())
        x = np.random.default_rng(h).standard_normal(self.vocab_size).astype(np.float32) * 3
        x[:3] = -np.inf  # specials never come out of the default mode
        x[self.text_ids:] = -np.inf
        return x

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.kv[dst, :length] = self.kv[src, :length]
        self.kv[dst, length:] = -1

    def reset_slot(self, slot: int) -> None:
        self.kv[slot] = -1

    def close(self) -> None:
        pass


async def submit_after(engine, spec: dict, yields: int, cancel_after: dict[str, int]):
    """Submit ``GenerationRequest(**spec)`` after ``yields`` event-loop turns (arrivals some steps apart),
    cancel it after ``cancel_after[request_id]`` events; returns (token ids, last event)."""
    from lineside.runtime.request import GenerationRequest

    for _ in range(yields):
        await asyncio.sleep(0)
    handle = engine.submit(GenerationRequest(**spec))
    ids, n, last = [], 0, None
    async for ev in handle:
        ids += ev.token_ids
        n += 1
        last = ev
        if n == cancel_after.get(spec["request_id"], -1):
            handle.cancel()
    return ids, last


class ReferenceProposer:
    """Proposes the plain-decoding continuation (known in advance), corrupting every ``wrong``-th token:
    drafts that are all kept, partly kept and all rejected, on a real model."""

    cheap = True

    def __init__(self, refs: dict[tuple[int, ...], list[int]], wrong: int = 4, *, span: int = 250, shift: int = 7):
        """A corrupted token is 3 + (token + shift) % span: another token inside a vocabulary of 3 + span."""
        self.refs, self.wrong, self.count, self.span, self.shift = refs, wrong, 0, span, shift

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for prompt, cont in self.refs.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                out = list(cont[len(tokens) - len(prompt):][:k])
                for i in range(len(out)):
                    self.count += 1
                    if self.count % self.wrong == 0:
                        out[i] = 3 + (out[i] + self.shift) % self.span
                return out
        return []
