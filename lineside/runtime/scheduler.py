"""Which sequences run in the next step: admission by priority and free KV, chunked prefill, preemption.

Every step is the decode batch (all sequences past prefill, one token each, slots in ascending
order, moved to 0..k-1 when a hole opens) plus at most one prefill chunk of ``prefill_chunk``
tokens for the one sequence being admitted. Waiting requests are ordered by rank (realtime
high/normal/low, then batch), lowered by ``aging_s`` per second waited so none starves. When
the best waiting request does not fit, running requests ranked at least one class below it are
preempted (their tokens are kept; they are re-admitted later and rebuild their KV, usually from
the prefix cache) — a realtime request never waits behind a batch job.

Single-token steps: a backend may compute a 1-token step by another path than a multi-token one
(onnxruntime's GroupQueryAttention has a token-generation path; with int8-activation MatMulNBits
(accuracy level 4) its last-bit differences become visible in the logits). So the engine keeps
each kind for its own job, as one-at-a-time generation does: decode steps are 1 token per row
(identical whatever the batch), prefill chunks are never a single token (unless the whole prompt
is), only prefill-written KV is offered for prefix reuse, and a preempted request replays its
generated tokens through decode steps. Then batching, chunking and prefix reuse give exactly the
tokens of `Generator`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from lineside.runtime.backend import StepBatch
from lineside.runtime.kv_manager import KVCacheArena, SlotOp
from lineside.runtime.sequence import DECODE, PREFILL, WAITING, Sequence


@dataclass
class StepPlan:
    ops: list[SlotOp] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    prefill: Sequence | None = None
    prefill_start: int = 0
    prefill_tokens: list[int] = field(default_factory=list)
    prefill_last: bool = False  # this chunk completes the fill

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.ops)

    def decode_batch(self) -> StepBatch:
        b = len(self.decode)
        return StepBatch(
            slots=[s.slot for s in self.decode],
            input_ids=np.array([[s.pending] for s in self.decode], dtype=np.int64),
            past_lengths=np.array([s.computed for s in self.decode], dtype=np.int64),
            new_lengths=np.ones(b, dtype=np.int64),
            logits_positions=np.zeros((b, 1), dtype=np.int64),
        )

    def prefill_batch(self) -> StepBatch:
        assert self.prefill is not None and self.prefill.slot is not None
        return StepBatch.single(self.prefill.slot, self.prefill_tokens, self.prefill_start)


def prefill_take(remaining: int, chunk: int) -> int:
    """Tokens for the next prefill chunk: at most ``chunk``, never leaving exactly one behind."""
    n = min(remaining, chunk)
    if remaining - n == 1:
        n = n - 1 if n > 2 else n + 1
    return n


class Scheduler:
    def __init__(self, arena: KVCacheArena, prefill_chunk: int = 512, aging_s: float = 10.0, preemption: bool = True):
        self.arena = arena
        self.prefill_chunk = max(2, int(prefill_chunk))
        self.aging_s = aging_s
        self.preemption = preemption
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # own a slot (prefill or decode)
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished / cancelled sequence out; frees its slot (the KV stays in the prefix cache)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        assert seq.slot is not None
        self.arena.truncate(seq.slot, seq.computed)
        self.arena.free(seq.slot)
        seq.slot = None

    def _move(self, seq: Sequence, dst: int) -> None:
        assert seq.slot is not None
        self.arena.move(seq.slot, dst)
        seq.slot = dst

    def _compact(self) -> None:
        """Move decoding sequences into slots 0..k-1 (k = how many decode), the prefilling one out of the way."""
        a = self.arena
        decode = [s for s in self.running if s.status == DECODE]
        k = len(decode)
        while True:
            hole = next((h for h in range(k) if a.owner[h] is None or a.owner[h].status != DECODE), None)
            if hole is None:
                return
            if a.owner[hole] is not None:  # the prefilling sequence sits in the decode range
                free = [i for i in range(k, a.num_slots) if a.owner[i] is None]
                if not free:
                    return  # every slot is taken: contiguous again once its prefill ends
                self._move(a.owner[hole], free[0])
            outside = max((s for s in decode if s.slot >= k), key=lambda s: s.slot)
            self._move(outside, hole)

    @property
    def prefilling(self) -> Sequence | None:
        return next((s for s in self.running if s.status == PREFILL), None)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> StepPlan:
        now = time.monotonic() if now is None else now
        self._compact()
        if self.prefilling is None:
            self._admit(now)
        plan = StepPlan(ops=self.arena.take_pending())
        plan.decode = sorted((s for s in self.running if s.status == DECODE), key=lambda s: s.slot)
        pf = self.prefilling
        if pf is not None:
            start = pf.computed
            plan.prefill, plan.prefill_start = pf, start
            plan.prefill_tokens = pf.fill[start:start + prefill_take(len(pf.fill) - start, self.prefill_chunk)]
            plan.prefill_last = start + len(plan.prefill_tokens) >= len(pf.fill)
        return plan

    def _admit(self, now: float) -> None:
        if not self.waiting:
            return
        best = min(self.waiting, key=lambda s: (s.effective_rank(now, self.aging_s), s.arrival))
        need = best.reserve_tokens
        if not self.arena.can_admit(need) and self.preemption:
            self._preempt_for(best, now)
        if not self.arena.can_admit(need):
            return
        self.waiting.remove(best)
        fill, max_reuse = best.start_fill()
        lowest = sum(s.status == DECODE for s in self.running)
        slot, reused = self.arena.allocate(best, fill, need, max_reuse, lowest)
        best.slot, best.computed = slot, reused
        best.handle.metrics.prefix_reused_tokens += reused if not best.generated else 0
        if best.handle.metrics.scheduled is None:
            best.handle.metrics.scheduled = now
        best.status = PREFILL if reused < len(fill) else DECODE
        self.running.append(best)

    def _preempt_for(self, want: Sequence, now: float) -> None:
        """Preempt running sequences of a lower class than ``want`` and ranked ≥ 1 below it after aging
        (lowest first), if that makes it fit. Aging lets a request through, it never lets it preempt a better class."""
        r = want.effective_rank(now, self.aging_s)
        victims = sorted((s for s in self.running
                          if s.rank > want.rank and s.effective_rank(now, self.aging_s) >= r + 1),
                         key=lambda s: (-s.effective_rank(now, self.aging_s), -s.arrival))
        a = self.arena
        free_slots = a.num_slots - a.occupied + len(victims)
        free_blocks = a.total_blocks - a.reserved_blocks + sum(a.reserved[s.slot] for s in victims)
        if free_slots < 1 or free_blocks < a.blocks_for(want.reserve_tokens):
            return
        for v in victims:
            if a.can_admit(want.reserve_tokens):
                break
            self.running.remove(v)
            self._release(v)
            v.status = WAITING
            v.handle.metrics.preemptions += 1
            self.preemptions += 1
            self.waiting.append(v)
