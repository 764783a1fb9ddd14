"""Runs one planned step on the backend (in the engine's worker thread) and samples its logits.

It only reads the sequences: what the step did to them is the scheduler's ``postprocess``, back on
the event loop. A failing backend call fails only the sequences in that call; a failing slot op
fails the whole step, because the slots it touched can't be trusted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lineside.runtime.backend import Backend
from lineside.runtime.kv_manager import SlotOpKind
from lineside.runtime.sequence import Sequence
from lineside.runtime.step_plan import StepPlan

log = logging.getLogger("lineside.engine")


@dataclass
class StepOutcome:
    sampled: dict[Sequence, int] = field(default_factory=dict)  # the token sampled for each sequence
    errors: dict[Sequence, str] = field(default_factory=dict)  # one line for each sequence whose call failed


def run_step(backend: Backend, plan: StepPlan) -> StepOutcome:
    """Slot ops, then the decode batch, then the prefill chunk."""
    out = StepOutcome()
    try:
        for op in plan.ops:
            if op.kind == SlotOpKind.COPY:
                backend.copy_slot(op.src, op.dst, op.length)
            else:
                backend.reset_slot(op.dst)
    except Exception as e:
        msg = error_line(e)
        return StepOutcome(errors={s: msg for s in [*plan.decode, *([plan.prefill] if plan.prefill else [])]})
    if plan.decode:
        try:
            logits = backend.forward(plan.decode_batch())
            for r, seq in enumerate(plan.decode):
                if seq.samples:
                    out.sampled[seq] = seq.sampler(logits[r, -1], seq.tokens, len(seq.prompt))
        except Exception as e:  # a backend failure ends the requests in this call, not the server
            out.errors.update((s, error_line(e)) for s in plan.decode if s not in out.sampled)
    seq = plan.prefill
    if seq is not None:
        try:
            logits = backend.forward(plan.prefill_batch())
            if plan.prefill_last and seq.pending is None:
                out.sampled[seq] = seq.sampler(logits[0, -1], seq.tokens, len(seq.prompt))
        except Exception as e:
            out.errors[seq] = error_line(e)
    return out


def error_line(e: Exception) -> str:
    """The one line a request that failed on ``e`` reports (the traceback goes to the log)."""
    log.error("engine step failed", exc_info=e)
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"model step failed: {first}"
