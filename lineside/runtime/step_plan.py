"""What one engine step is: slot ops, the decode batch, at most one prefill chunk — and their backend batches.

The scheduler fills a ``StepPlan``, the step runner executes it, and the scheduler's ``postprocess``
reads it back to apply the outcome; the plan itself changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lineside.runtime.backend import StepBatch
from lineside.runtime.kv_manager import SlotOp
from lineside.runtime.sequence import Sequence


@dataclass
class StepPlan:
    """One step: slot ops first, then the decode batch, then the prefill chunk (see ``Scheduler.schedule``)."""

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
