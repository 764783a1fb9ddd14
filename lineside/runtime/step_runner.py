"""Runs one planned step on the backend (in the engine's step thread) and samples its logits.

It only reads the sequences: what the step did to them is the scheduler's ``postprocess``, applied after it
under the engine's state lock. A failing backend call fails only the sequences in that call; a failing slot op
fails the whole step, because the slots it touched can't be trusted. Rows under a grammar get their
token masks computed together (``structured.fill_masks``) and applied in the sampler; a verifying row's
later positions get theirs from its matcher advanced through the kept drafts (speculative/verify.py),
which is rolled back before the step returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from lineside.errors import LinesideError
from lineside.runtime.backend import Backend, StepBatch, has_whole_state
from lineside.runtime.engine_health import BackendLost, StepVerdict
from lineside.runtime.kv_manager import SlotOpKind
from lineside.runtime.sampling import TokenLogprob, token_logprob
from lineside.runtime.sequence import Sequence
from lineside.runtime.speculative.config import DraftRow, ModelProposer
from lineside.runtime.speculative.verify import scorable, verify_drafts
from lineside.runtime.step_plan import StepPlan
from lineside.runtime.structured import fill_masks, new_bitmask, unpack_bitmask

log = logging.getLogger("lineside.engine")


@dataclass
class StepOutcome:
    sampled: dict[Sequence, int] = field(default_factory=dict)  # the token sampled for each sequence
    accepted: dict[Sequence, list[int]] = field(default_factory=dict)  # drafts kept, before its sampled token
    errors: dict[Sequence, str] = field(default_factory=dict)  # one line for each sequence whose call failed
    # for the sequences that asked: one per emitted token (the kept drafts', then the sampled one's)
    logprobs: dict[Sequence, list[TokenLogprob]] = field(default_factory=dict)
    session_error: str | None = None  # the prefill session's chunk failed (the session is released, no request)
    settle_error: str | None = None  # the settle chunk failed (its answer's tail is dropped from the cache)
    # for the sequences scoring their prompt: the prompt tokens a chunk's logits scored (those after its first token)
    prompt_logprobs: dict[Sequence, list[TokenLogprob]] = field(default_factory=dict)
    calls_ok: int = 0  # backend forwards that succeeded (a slot op alone proves little): the engine's health reads these
    calls_failed: int = 0  # ... and that raised
    call_error: str | None = None  # the first failed call's line
    fatal: bool = False  # a call raised BackendLost: the backend cannot be trusted again

    def failed_call(self, e: Exception) -> str:
        """Count a backend call that raised ``e``; its one line."""
        msg = error_line(e)
        self.calls_failed += 1
        self.call_error = self.call_error or msg
        self.fatal = self.fatal or isinstance(e, BackendLost)
        return msg

    def verdict(self) -> StepVerdict:
        """What this step tells about the backend (engine_health.py)."""
        return StepVerdict(ok=self.calls_ok, failed=self.calls_failed, error=self.call_error, fatal=self.fatal)


def run_step(backend: Backend, plan: StepPlan, proposer: ModelProposer | None = None) -> StepOutcome:
    """Slot ops, then a model proposer's drafts, then the decode batch, then the prefill chunks, then a prefill
    session's chunk (last: requests first)."""
    out = StepOutcome()
    try:
        for load in plan.adapter_loads:
            if load.adapter is None:  # an unloaded adapter's slot, emptied once its last request ended
                backend.unload_adapter(load.slot)  # type: ignore[attr-defined] (a LoraBackend)
            else:
                backend.load_adapter(load.slot, load.adapter)  # type: ignore[attr-defined] (a LoraBackend)
        for op in plan.ops:
            if op.kind == SlotOpKind.COPY:
                backend.copy_slot(op.src, op.dst, op.length)
            else:
                backend.reset_slot(op.dst)
    except Exception as e:
        msg = out.failed_call(e)
        out.errors = {s: msg for s in [*plan.decode, *(c.seq for c in plan.prefills)]}
        out.session_error = msg if plan.session is not None else None
        out.settle_error = msg if plan.settle is not None else None
        return out
    if plan.draft_budget and proposer is not None:
        _propose(proposer, plan)
    if plan.decode:
        try:
            saved = _save_whole_state(backend, plan)
            logits = backend.forward(plan.decode_batch())
            out.calls_ok += 1
            masks = grammar_masks(plan.decode, logits.shape[-1])
            for r, seq in enumerate(plan.decode):
                try:
                    _decode_row(out, backend, plan, saved, seq, logits[r], None if masks is None else masks[r])
                except LinesideError as e:  # the row's own (the sampler: a row of NaN logits), not the batch's
                    out.errors[seq] = error_line(e)
        except Exception as e:  # a backend failure ends the requests in this call, not the server
            msg = out.failed_call(e)
            out.errors.update((s, msg) for s in plan.decode if s not in out.sampled)
    for chunk in plan.prefills:  # one forward each: GroupQueryAttention takes one past length per batch
        seq = chunk.seq
        try:
            logits = backend.forward(chunk.batch())
        except Exception as e:
            out.errors[seq] = out.failed_call(e)
            continue
        out.calls_ok += 1
        try:
            if seq.scores_prompt:
                out.prompt_logprobs[seq] = score_prompt(seq, chunk.start, logits[0])
            if chunk.last and seq.pending is None and seq.max_tokens > 0:
                masks = grammar_masks([seq], logits.shape[-1])
                _sample(out, seq, logits[0, -1], None if masks is None else masks[0])
        except Exception as e:  # the row's own (its sampler or grammar), not the backend's
            out.errors[seq] = error_line(e)
    if plan.session is not None:
        try:
            backend.forward(plan.session.batch())
            out.calls_ok += 1
        except Exception as e:
            out.session_error = out.failed_call(e)
    if plan.settle is not None:
        try:
            backend.forward(plan.settle.batch())
            out.calls_ok += 1
        except Exception as e:
            out.settle_error = out.failed_call(e)
    return out


def _decode_row(out: StepOutcome, backend: Backend, plan: StepPlan, saved: dict | None, seq: Sequence,
                logits: np.ndarray, allowed: np.ndarray | None) -> None:
    """Verify a decode row's drafts, or sample its next token, from its logits."""
    drafts = plan.drafts.get(seq)
    if drafts:  # nothing past a token the grammar rejects (Scheduler._drafts, scorable); each masked
        v = verify_drafts(seq.sampler, logits, drafts, seq.tokens, len(seq.prompt), matcher=seq.matcher,
                          first_allowed=allowed, logprobs=seq.logprobs, probs=plan.draft_probs.get(seq))
        out.accepted[seq], out.sampled[seq] = v.kept, v.token
        if v.logprobs:
            out.logprobs[seq] = v.logprobs
        if saved is not None and len(v.kept) < len(drafts):
            _rewind(backend, saved, seq, v.kept)
    elif seq.samples:
        _sample(out, seq, logits[0], allowed)


def _save_whole_state(backend: Backend, plan: StepPlan) -> dict | None:
    """Whole-state tensors (DeepSeek-V4's compressor state, mode replace) advance over every token a step
    feeds, rejected drafts too: keep the verifying rows' state from before the step (None: nothing to keep)."""
    if not plan.drafts or not has_whole_state(backend):
        return None
    return backend.save_rows([int(s.slot or 0) for s in plan.drafts])  # type: ignore[attr-defined]


def _rewind(backend: Backend, saved: dict, seq: Sequence, kept: list[int]) -> None:
    """Put the row's whole state back to the accepted length: restore it and feed again what was kept (the
    pending token and the kept drafts; their KV positions are rewritten with the same values)."""
    backend.restore_rows(saved, int(seq.slot or 0))  # type: ignore[attr-defined]
    assert seq.pending is not None
    backend.forward(StepBatch.single(int(seq.slot or 0), [seq.pending, *kept], seq.computed))


def _propose(proposer: ModelProposer, plan: StepPlan) -> None:
    """A model proposer's drafts for the rows the scheduler gave a budget; if it fails, the step decodes
    without drafts (proposals are only ever a guess)."""
    seqs = list(plan.draft_budget)
    rows = [DraftRow(int(s.slot or 0), s.tokens, k, s.sampler, len(s.prompt)) for s, k in plan.draft_budget.items()]
    try:
        drafts = proposer.propose_rows(rows)
    except Exception as e:
        log.error("draft proposer failed; decoding this step without drafts", exc_info=e)
        return
    for seq, d in zip(seqs, drafts, strict=True):
        d = scorable(seq.matcher, d)  # nothing past a token the grammar forbids
        if d.tokens:
            plan.drafts[seq] = d.tokens
            if d.probs is not None:
                plan.draft_probs[seq] = d.probs


def grammar_masks(seqs: list[Sequence], vocab_size: int) -> np.ndarray | None:
    """bool ``[len(seqs), vocab]`` allowed tokens for the rows under a grammar (others all True); None when
    no row has one (or none has started: a reasoning model's still thinking), so unconstrained steps do no mask
    work at all."""
    rows = [(seq.matcher, r) for r, seq in enumerate(seqs)
            if seq.matcher is not None and seq.matcher.active and seq.samples]
    if not rows:
        return None
    bitmask = new_bitmask(len(seqs), vocab_size)
    fill_masks(rows, bitmask)
    return unpack_bitmask(bitmask, vocab_size)


def score_prompt(seq: Sequence, start: int, logits: np.ndarray) -> list[TokenLogprob]:
    """The prompt tokens a chunk at ``start`` scores: the logits at position p give token p + 1's logprob (the model's
    own, before any of the request's sampling settings), with the request's number of alternatives and its rank."""
    top_n = int(seq.req.prompt_logprobs or 0)
    prompt = seq.prompt
    return [token_logprob(logits[j], prompt[start + j + 1], top_n, ranked=True)
            for j in range(logits.shape[0]) if start + j + 1 < len(prompt)]


def _sample(out: StepOutcome, seq: Sequence, logits: np.ndarray, allowed: np.ndarray | None) -> None:
    res = seq.sampler.step(logits, seq.tokens, len(seq.prompt), allowed=allowed, logprobs=seq.logprobs)
    out.sampled[seq] = res.token
    if res.logprob is not None:
        out.logprobs[seq] = [res.logprob]


def error_line(e: Exception) -> str:
    """The one line a request that failed on ``e`` reports (the traceback goes to the log)."""
    log.error("engine step failed", exc_info=e)
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"model step failed: {first}"
