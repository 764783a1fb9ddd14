"""What one engine step is: slot ops, the decode batch, the requests' prefill chunks (or else a prefill session's
chunk) — and their backend batches.

The scheduler fills a ``StepPlan``, the step runner executes it, and the scheduler's ``postprocess``
reads it back to apply the outcome; the plan itself changes nothing. (The one thing the step runner
writes into it: a model proposer's drafts, made in the step thread.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lineside.runtime.adapter_slots import AdapterLoad
from lineside.runtime.backend import StepBatch
from lineside.runtime.kv_manager import SlotOp
from lineside.runtime.sequence import Sequence


@dataclass
class SessionChunk:
    """KV for a prefill session's tokens ``start..start+len(tokens)`` in its pinned ``slot``; no logits are used."""

    session: Any  # a sessions.PrefillSession
    slot: int
    start: int
    tokens: list[int]

    def batch(self) -> StepBatch:
        return StepBatch.single(self.slot, self.tokens, self.start)


@dataclass
class SettleChunk:
    """A finished answer's ids ``start..start+len(tokens)`` recomputed by prefill into the free ``slot`` (its
    decode-written KV becomes reusable: kv_manager's ``keep_answer``); no logits are used."""

    slot: int
    start: int
    tokens: list[int]

    def batch(self) -> StepBatch:
        return StepBatch.single(self.slot, self.tokens, self.start, prompt=True)


@dataclass
class PrefillChunk:
    """Prompt tokens ``start..start+len(tokens)`` of a request being admitted, computed into its slot."""

    seq: Sequence
    start: int
    tokens: list[int]
    last: bool  # this chunk completes the fill: its last logits give the first token

    def batch(self) -> StepBatch:
        assert self.seq.slot is not None
        return StepBatch.single(self.seq.slot, self.tokens, self.start, adapter=self.seq.adapter_slot,
                                all_logits=self.seq.scores_prompt, prompt=True)


@dataclass
class StepPlan:
    """One step: slot ops first, then the decode batch, then the prefill chunks (see ``Scheduler.schedule``)."""

    ops: list[SlotOp] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)  # within the step's prefill budget, oldest first
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # proposed tokens to verify, by decode row
    session: SessionChunk | None = None  # idle-capacity work: only in a step without a request's prefill chunk
    settle: SettleChunk | None = None  # idle-engine work: only in a step with nothing else to run
    # A model proposer's rows: how many tokens each may propose. The step runner runs the proposer and
    # fills ``drafts`` (and ``draft_probs``) before the decode batch is made; postprocess reads them back.
    draft_budget: dict[Sequence, int] = field(default_factory=dict)
    draft_probs: dict[Sequence, list[np.ndarray]] = field(default_factory=dict)  # q of sampled drafts
    adapter_loads: list[AdapterLoad] = field(default_factory=list)  # LoRA slot writes, before everything else

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefills or self.ops or self.session or self.settle
                    or self.adapter_loads)

    @property
    def prefill_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.prefills)

    def decode_batch(self) -> StepBatch:
        """Each row feeds its pending token, then its drafts (right-padded), with logits at every one."""
        b = len(self.decode)
        rows = [[s.pending, *self.drafts.get(s, [])] for s in self.decode]
        width = max((len(r) for r in rows), default=1)
        ids = np.zeros((b, width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        new = np.array([len(r) for r in rows], dtype=np.int64)
        return StepBatch(
            slots=[s.slot for s in self.decode],
            input_ids=ids,
            past_lengths=np.array([s.computed for s in self.decode], dtype=np.int64),
            new_lengths=new,
            logits_positions=np.minimum(np.arange(width, dtype=np.int64)[None, :], (new - 1)[:, None]),
            adapters=np.array([s.adapter_slot for s in self.decode], dtype=np.int64)
            if any(s.adapter_slot for s in self.decode) else None,
        )


# A prompt scored at every position (completions' echo with logprobs) takes logits [chunk, vocab] per step: its
# chunks hold at most this many float32 logits (64 MiB; 341 tokens of SmolLM2's 49,152-token vocabulary, 107 of
# Qwen2's 151,936), so a long prompt costs more steps, never more memory.
PROMPT_LOGIT_FLOATS = 1 << 24


def prompt_logit_rows(vocab_size: int) -> int:
    """Most tokens in a chunk of a prompt scored at every position (at least 2: chunks are never 1 token)."""
    return max(2, PROMPT_LOGIT_FLOATS // max(1, int(vocab_size)))


def prefill_take(remaining: int, chunk: int) -> int:
    """Tokens for the next prefill chunk: at most ``chunk``, never leaving exactly one behind."""
    n = min(remaining, chunk)
    if remaining - n == 1:
        n = n - 1 if n > 2 else n + 1
    return n
