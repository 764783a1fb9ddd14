"""Which sequences run in the next step, and what a step did to them: the one owner of sequence state.

``schedule`` plans a step: the decode batch (all sequences past prefill, one token each, slots in
ascending order — moved into one range of slots when a hole opens, if the backend ``needs_contiguous_slots``;
the range stays where most of them already are, so the free slots keep their cached prefixes)
plus prefill chunks of the sequences being admitted, ``prefill_chunk`` tokens in all (step_plan.py): a burst of
short prompts is admitted in one step, as vLLM's token budget does, so the requests decode together from the
next step instead of joining one a step (fewer, fuller decode steps; the last request's first token 1 step
away, not N). A prompt that begins with a block another prompt's prefill is still computing waits for it, to
reuse it from the prefix cache rather than compute it again. ``postprocess`` is the one place that applies a step's outcome (as nano-vllm's does): it records
the KV the step wrote in the arena, advances the sequences, appends sampled tokens, finishes
sequences (stop / length / error) and frees their slots; ``expire`` and ``abort`` finish the
cancelled and timed-out ones. Every time comes from one injected clock.

Waiting requests are ordered by rank (realtime high/normal/low, then batch), lowered by
``aging_s`` per second waited so none starves; the prefills under way share a step's budget in the
same order. When the best waiting request does not fit, running requests ranked at least one class
below it are preempted (their tokens are kept; they are re-admitted later and rebuild their KV, usually
from the prefix cache) — a realtime request never waits behind a batch job.

Single-token steps: a backend may compute a 1-token step by another path than a multi-token one
(onnxruntime's GroupQueryAttention has a token-generation path; with int8-activation MatMulNBits
(accuracy level 4) its last-bit differences become visible in the logits). So the engine keeps
each kind for its own job, as one-at-a-time generation does: decode steps are 1 token per row
(identical whatever the batch), prefill chunks are never a single token (unless the whole prompt
is), only prefill-written KV is offered for prefix reuse, and a preempted request replays its
generated tokens through decode steps. Then batching, chunking and prefix reuse give exactly the
tokens of `Generator`.

A finished answer: its KV came from decode steps, so it is not offered for reuse as written; while the engine has
nothing else to run, ``settle_chunk``-token prefill chunks recompute it from the answer's ids (its last token
included, whose KV no step wrote), and then a chat's next turn (the prompt, the answer, the new message) reuses all
but the new message — what vLLM's prefix cache reuses — with the KV a fresh prefill of that prompt computes, so
the answer stays the same. A request arriving meanwhile waits at most one such chunk.

Speculation (given a ``proposer``): ``schedule`` asks it for up to the row's draft length
(speculative/adaptive.py) of proposed tokens per decoding row — never more than max_tokens or the
context leave room for, none while replaying — and the step scores them with the pending token in one
multi-token forward. A model proposer (a draft bundle, layerskip) only gets each row's budget here; it runs
in the step, in the step thread (step_runner.py), so the event loop never waits on a draft model. ``postprocess`` records the pending token and the kept drafts as the slot's KV;
the positions written for rejected drafts lie past it and are overwritten by the next step. A row under a
grammar only proposes the drafts its matcher accepts, and each is verified against the masked distribution
plain decoding would use at its position (speculative/verify.py). Kept drafts
and the sampled token then go through ``on_token`` one by one, so stop tokens, stop strings and
max_tokens drop whatever follows them. (With accuracy level 4 a multi-token step's logits differ in
the last bits from a 1-token step's, so speculation is lossless at level 0, see tests/runtime.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lineside.runtime.kv_manager import KVCacheArena
from lineside.runtime.request import FinishReason, TokenEvent
from lineside.runtime.sampling import TokenLogprob
from lineside.runtime.sequence import Sequence
from lineside.runtime.sequence import SequenceStatus as Status
from lineside.runtime.session_scheduling import SessionSlots
from lineside.runtime.sessions import PrefillSession, SessionStore, common_prefix
from lineside.runtime.speculative.adaptive import DraftLength
from lineside.runtime.speculative.config import ModelProposer, Proposer
from lineside.runtime.step_plan import PrefillChunk, SettleChunk, StepPlan, prefill_take

SETTLE_CHUNK = 32  # tokens per settle chunk: a request arriving during one waits for it (~20 ms on 2 cores)
ACCEPTANCE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # per verifying row and step
Clock = Callable[[], float]  # seconds, monotonic: time.monotonic in service, a fake in tests


class Scheduler(SessionSlots):
    """Owns every sequence from ``add`` to its end: the queues, its slot (through the arena), its state; and the
    prefill sessions' slots (session_scheduling.py)."""

    def __init__(self, arena: KVCacheArena, *, prefill_chunk: int = 512, aging_s: float = 10.0,
                 preemption: bool = True, contiguous_slots: bool = False, clock: Clock = time.monotonic,
                 proposer: Proposer | ModelProposer | None = None, spec_tokens: int = 0,
                 spec_max_rows: int | None = None, verify_cost: float = 1.0, verify_token_cost: float = 0.0,
                 sessions: SessionStore | None = None, session_every: int = 4, session_busy_chunk: int = 32,
                 settle_chunk: int = SETTLE_CHUNK):
        self.arena = arena
        self.prefill_chunk = max(2, int(prefill_chunk))
        self.aging_s = aging_s
        self.preemption = preemption
        self.contiguous_slots = contiguous_slots  # the backend's needs_contiguous_slots
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # own a slot (prefill or decode)
        self.preemptions = 0
        self.generated_tokens = 0
        self.proposer = proposer if spec_tokens > 0 else None
        self.spec_tokens = spec_tokens
        self.spec_max_rows = spec_max_rows  # speculate only in steps with at most this many decode rows
        self.verify_cost = verify_cost  # a verification step's time in 1-token steps (the adaptive rule's bar)
        self.verify_token_cost = verify_token_cost  # and what each drafted token adds to it
        self.spec_drafted = 0  # proposed tokens scored by the model
        self.spec_accepted = 0  # of those, kept
        self.spec_steps = 0  # decode rows that verified drafts
        self.spec_rate_counts = [0] * len(ACCEPTANCE_BUCKETS)  # verifying rows by acceptance rate (≤ bucket bound)
        self.spec_rate_sum = 0.0
        self.sessions = sessions  # None: this engine keeps no prefill sessions
        self.session_every = max(1, int(session_every))
        self.session_busy_chunk = max(2, int(session_busy_chunk))  # session chunk size while requests decode
        self._quiet_steps = 0  # steps since the last session chunk
        self.settle_chunk = max(2, int(settle_chunk))  # 0 or 1: 2 (a chunk is never 1 token)
        self.settled_tokens = 0  # answer tokens recomputed by settle chunks (their KV is now reusable)
        # A LoRA adapter's request runs once its adapter holds a backend slot: ``adapter_gate(seq)`` tries to give it
        # one (the engine's AdapterSlots); a request it refuses waits, skipped by admission as vLLM's scheduler skips
        # a request whose LoRA does not fit this step, until a finished request frees a slot.
        self.adapter_gate: Callable[[Sequence], bool] | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        # rows under a grammar speculate too: their drafts are cut where the grammar rejects one (``_drafts``)
        if self.proposer is not None and seq.req.speculative and seq.draft_length is None:
            seq.draft_length = DraftLength(self.spec_tokens, verify_cost=self.verify_cost,
                                           verify_token_cost=self.verify_token_cost,
                                           draft_cost=float(getattr(self.proposer, "cost", 0.0)))
        self.waiting.append(seq)

    @property
    def prefilling(self) -> list[Sequence]:
        """The sequences admitted whose prompt is not all computed yet (``schedule`` serves them by ``_order``)."""
        return [s for s in self.running if s.status == Status.PREFILL]

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> StepPlan:
        now = self.clock() if now is None else now
        if self.contiguous_slots:
            self._compact()
        self._admit_within_budget(now)
        self._place_sessions(now)
        plan = StepPlan(ops=self.arena.take_pending())
        plan.decode = sorted((s for s in self.running if s.status == Status.DECODE), key=lambda s: s.slot)
        if self.proposer is not None:
            self._drafts(plan)
        budget = self.prefill_chunk
        for pf in sorted(self.prefilling, key=lambda s: self._order(s, now)):
            if budget < 2:  # never a 1-token chunk (module docstring)
                break
            start = pf.computed
            room = budget if pf.prompt_rows is None else min(budget, pf.prompt_rows)  # logits at each: bounded
            tokens = pf.fill[start:start + prefill_take(len(pf.fill) - start, room)]
            plan.prefills.append(PrefillChunk(pf, start, tokens, last=start + len(tokens) >= len(pf.fill)))
            budget -= len(tokens)
        self._session_chunk(plan)
        self._settle(plan)
        return plan

    def _settle(self, plan: StepPlan) -> None:
        """Plan a chunk of the latest finished answer's KV (module docstring) into a step that has nothing else."""
        if not plan.empty or self.waiting or self.running:
            return
        slot = self.arena.next_unsettled()
        if slot is None:
            return
        ids, start = self.arena.unsettled[slot], self.arena.shared[slot]
        plan.settle = SettleChunk(slot, start, ids[start:start + prefill_take(len(ids) - start, self.settle_chunk)])

    def _settle_applied(self, plan: StepPlan, error: str | None) -> None:
        sc = plan.settle
        if sc is None:
            return
        if error is not None:  # what the failed call wrote there is unknown: nothing past its start is kept
            self.arena.truncate(sc.slot, sc.start)
            return
        self.arena.settled(sc.slot, sc.start, sc.tokens)
        self.settled_tokens += len(sc.tokens)

    def postprocess(self, plan: StepPlan, sampled: dict[Sequence, int], errors: dict[Sequence, str],
                    now: float | None = None, logprobs: dict[Sequence, list[TokenLogprob]] | None = None,
                    accepted: dict[Sequence, list[int]] | None = None,
                    session_error: str | None = None, settle_error: str | None = None,
                    prompt_logprobs: dict[Sequence, list[TokenLogprob]] | None = None
                    ) -> list[tuple[Sequence, TokenEvent]]:
        """Apply a step's outcome: ``sampled`` tokens by sequence, ``errors`` (one line each) for the
        sequences whose backend call failed, ``logprobs`` of the emitted tokens for the rows that asked
        (one per kept draft, then the sampled token's), ``accepted``: the drafts each verifying row kept
        (they come before its sampled token), ``session_error``: the session chunk failed, ``prompt_logprobs``:
        the prompt tokens each scoring chunk scored. Returns the events to deliver, in order."""
        now = self.clock() if now is None else now
        accepted = accepted or {}
        self._session_applied(plan, session_error)
        self._settle_applied(plan, settle_error)
        events = [(seq, ev) for seq, msg in errors.items() if (ev := self.abort(seq, FinishReason.ERROR, msg, now=now))]
        for seq in plan.decode:  # each fed ``pending`` (or the next replayed token), then its drafts
            if seq.status != Status.DECODE or seq.slot is None or seq in errors:
                continue
            kept = accepted.get(seq, [])
            self.arena.append(seq.slot, [seq.pending, *kept], shareable=False)
            seq.computed += 1 + len(kept)
            if seq.replay:
                seq.pending = seq.replay.popleft()
            drafts = plan.drafts.get(seq)
            if drafts and seq.draft_length is not None and seq in sampled:
                self.spec_drafted += len(drafts)
                self.spec_accepted += len(kept)
                self.spec_steps += 1
                seq.handle.metrics.spec_drafted += len(drafts)
                seq.handle.metrics.spec_accepted += len(kept)
                seq.draft_length.observe(len(drafts), len(kept))
                rate = len(kept) / len(drafts)
                self.spec_rate_counts[next(i for i, b in enumerate(ACCEPTANCE_BUCKETS) if rate <= b)] += 1
                self.spec_rate_sum += rate
            elif seq.shadow is not None and seq.draft_length is not None and seq in sampled:
                seq.draft_length.observe(1, int(sampled[seq] == seq.shadow))
            seq.shadow = None
        for chunk in plan.prefills:
            pf = chunk.seq
            if pf.status != Status.PREFILL or pf.slot is None or pf in errors:
                continue
            self.arena.append(pf.slot, chunk.tokens, shareable=len(chunk.tokens) > 1)
            pf.computed += len(chunk.tokens)
            pf.prompt_logprobs.extend((prompt_logprobs or {}).get(pf, []))
            if chunk.last:
                pf.status = Status.DECODE
                if pf.max_tokens == 0:  # nothing to generate: the prompt (and its scores) is the answer
                    events.append((pf, pf.prompt_done()))
                    self._finish(pf, now)
        for seq, tok in sampled.items():
            kept = accepted.get(seq, [])
            lps = (logprobs or {}).get(seq, [])
            for j, t in enumerate([*kept, tok]):
                if seq.status == Status.FINISHED:
                    break
                self.generated_tokens += 1
                ev = seq.on_token(t, now, lps[j] if j < len(lps) else None)
                if ev.finish_reason is not None:
                    self._finish(seq, now)
                events.append((seq, ev))
        return events

    def _drafts(self, plan: StepPlan) -> None:
        """Proposed tokens for each decoding row that speculates; k leaves room for the token sampled after
        them within max_tokens and the context. A token proposer guesses here (``plan.drafts``); a model
        proposer gets the row's k (``plan.draft_budget``) and runs in the step, off the event loop. At draft
        length 0 a cheap proposer's 1-token guess is kept as ``shadow`` to be checked against the sample (so
        the length can grow back)."""
        assert self.proposer is not None
        decode = plan.decode
        if self.spec_max_rows is not None and len(decode) > self.spec_max_rows:
            for seq in decode:
                seq.shadow = None
            return
        batched = hasattr(self.proposer, "propose_rows")
        for seq in decode:
            dl = seq.draft_length
            if dl is None or not seq.samples:
                continue
            room = min(seq.max_tokens - len(seq.generated) - 1, self.arena.max_seq_len - seq.computed - 1)
            if room <= 0:
                continue
            k = dl.budget(self.proposer.cheap)
            if k == 0:
                if self.proposer.cheap:
                    guess = self._grammatical(seq, self.proposer.propose(seq.tokens, 1))
                    seq.shadow = guess[0] if guess else None
                continue
            if batched:
                plan.draft_budget[seq] = min(k, room)
                continue
            drafts = self._grammatical(seq, self.proposer.propose(seq.tokens, min(k, room)))
            if drafts:
                plan.drafts[seq] = drafts

    @staticmethod
    def _grammatical(seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the row's grammar rejects (all of them without a grammar): a
        token the mask would forbid can never be kept, so it is not worth scoring."""
        if seq.matcher is None or not drafts:
            return drafts
        return drafts[:seq.matcher.validate(drafts)]

    def expire(self, now: float | None = None) -> list[tuple[Sequence, TokenEvent]]:
        """Finish the cancelled and the timed-out sequences (waiting or running), release expired prefill
        sessions; returns the sequences' final events."""
        now = self.clock() if now is None else now
        self.expire_sessions(now)
        events = []
        for seq in [*self.waiting, *self.running]:
            if seq.handle.cancel_requested:
                ev = self.abort(seq, FinishReason.CANCELLED, now=now)
            elif seq.deadline is not None and now >= seq.deadline:
                ev = self.abort(seq, FinishReason.TIMEOUT, now=now)
            else:
                continue
            if ev is not None:
                events.append((seq, ev))
        return events

    def abort(self, seq: Sequence, reason: FinishReason, error: str | None = None, *,
              now: float | None = None) -> TokenEvent | None:
        """End ``seq`` early (cancelled / timeout / error) and free its slot; its final event, or None if it
        had already finished. Works on a sequence not added yet too (the engine's stop and crash paths)."""
        if seq.status == Status.FINISHED:
            return None
        ev = seq.abort(reason, error)
        # a failed call's ids are not settled: recomputing them would likely fail again (and count as failed steps)
        self._finish(seq, self.clock() if now is None else now, answer=reason != FinishReason.ERROR)
        return ev

    def _finish(self, seq: Sequence, now: float, answer: bool = True) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self._session_done(seq, now)  # a session it named may keep its slot for the next turn
            if seq.slot is not None:
                self._release(seq, answer)  # its KV stays in the prefix cache, its answer's settled
        else:
            self._session_done(seq, now)  # ended while waiting (preempted): a session lent to it ends too
        seq.status = Status.FINISHED
        seq.handle.metrics.finished = now

    # ---- slots ---------------------------------------------------------------------------------
    def _release(self, seq: Sequence, answer: bool = False) -> None:
        """Free ``seq``'s slot; ``answer``: it has ended (not preempted), so its answer is worth settling."""
        assert seq.slot is not None
        self.arena.truncate(seq.slot, seq.computed)
        self.arena.free(seq.slot)
        if answer and seq.req.settle_answer:
            self.arena.keep_answer(seq.slot, [*seq.prompt, *seq.generated])
        seq.slot = None

    def _move(self, seq: Sequence, dst: int) -> None:
        assert seq.slot is not None
        self.arena.move(seq.slot, dst)
        seq.slot = dst

    def _compact(self) -> None:
        """Move decoding sequences into one range of slots (``_window``), the prefilling ones and sessions out of it."""
        decode = [s for s in self.running if s.status == Status.DECODE]
        if not decode:
            return
        window = self._window(decode)
        while True:
            by_slot = {s.slot: s for s in self.running}
            hole = next((h for h in window if h not in by_slot or by_slot[h].status != Status.DECODE), None)
            if hole is None:
                return
            held = self.arena.owner[hole]
            if held is not None:  # a prefilling sequence or a session's pinned slot sits in the decode range
                free = [i for i, o in enumerate(self.arena.owner) if o is None and i not in window]
                if free:
                    dst = self.arena.victim(avoid=window)
                    if isinstance(held, PrefillSession):
                        self.arena.move(hole, dst)
                        held.slot = dst
                    else:
                        self._move(by_slot[hole], dst)
                elif isinstance(held, PrefillSession):
                    self.release_session(held, evicted=True)
                else:
                    return  # every slot is taken: contiguous again once its prefill ends
            outside = max((s for s in decode if s.slot not in window), key=lambda s: s.slot)
            self._move(outside, hole)

    def _window(self, decode: list[Sequence]) -> range:
        """Where the decode batch goes: the range of its size needing the fewest moves (decoders to bring in, others
        to move out), then overwriting the least valuable free slots' cached KV. A batch already in one range (one
        decoder, say) stays where it is: moving it to slot 0 would overwrite the prefix cached there for nothing."""
        k, owner = len(decode), self.arena.owner
        mine = {s.slot for s in decode}

        def cost(w: int) -> tuple[int, tuple[int, int], int]:
            r = range(w, w + k)
            moves = sum(s not in r for s in mine) + sum(owner[i] is not None and i not in mine for i in r)
            lost = max((self.arena.worth(i) for i in r if owner[i] is None), default=(0, 0))
            return moves, lost, w

        return range(w := min(range(self.arena.num_slots - k + 1), key=cost), w + k)

    # ---- admission and preemption -------------------------------------------------------------
    def _admit_within_budget(self, now: float) -> None:
        """Admit waiting requests while this step's prefill budget has room for more than the prefills under way
        that rank before them (one admission at least, when none is under way). The next in line is held back when
        its prompt starts with a block an admitted prompt is still computing: the step after, it reuses that block."""
        while self.waiting:
            best = self._next_waiting(now)
            if best is None:  # every waiting request waits for an adapter slot
                return
            key = self._order(best, now)
            # only the prefills served before it in a step's budget (``schedule``) take its room: a realtime request
            # does not wait for a batch job's long prompt to be computed (it may preempt the job for its slot)
            ahead = [s for s in self.prefilling if self._order(s, now) <= key]
            room = self.prefill_chunk - sum(len(s.fill) - s.computed for s in ahead)
            if room < 2:
                return
            jumps = len(ahead) < len(self.prefilling)  # it goes before a prefill under way
            if self.prefilling and not jumps and self.arena.free_slots <= 1 and len(best.prompt) > room:
                # the last free slot, and some prefill would go on past this step: keep the slot, so that a prefill
                # ending before one in a lower slot can move out of the decode range through it (``_compact``)
                return
            if self._awaits_shared_prefix(best):
                return
            if self._admit(best, now) is None:
                return

    def _order(self, seq: Sequence, now: float) -> tuple[float, float]:
        """Who goes first: in the waiting queue, and for a step's prefill budget (lower first)."""
        return seq.effective_rank(now, self.aging_s), seq.arrival

    def _next_waiting(self, now: float) -> Sequence | None:
        """The first in line that can run: a LoRA adapter's request once its adapter has a slot (``adapter_gate``)."""
        if self.adapter_gate is None:
            return min(self.waiting, key=lambda s: self._order(s, now))
        for seq in sorted(self.waiting, key=lambda s: self._order(s, now)):
            if seq.req.adapter is None or seq.adapter_slot or self.adapter_gate(seq):
                return seq
        return None

    def _awaits_shared_prefix(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt shares a full block with a prefill in flight (same adapter) beyond what that
        prefill has computed: admitting it now would compute the block twice."""
        bs = self.arena.block_size
        for pf in self.prefilling:
            if pf.cache_namespace == seq.cache_namespace and common_prefix(seq.prompt, pf.fill) // bs * bs > pf.computed:
                return True
        return False

    def _admit(self, best: Sequence, now: float) -> Sequence | None:
        """Give ``best`` a slot (reusing what the prefix cache holds of it), preempting lower classes if it needs
        room; None when it does not fit yet."""
        need = best.reserve_tokens
        fill, max_reuse = best.start_fill()
        # the session it names, when its KV extends this prompt (sessions hold base-model KV: never an adapter's)
        lend = self._lendable(best, len(fill), max_reuse) if best.req.adapter is None else None
        freeing = [] if lend is None or lend[0].slot is None else [lend[0].slot]
        if not self.arena.can_admit(need, freeing):  # idle sessions go before any running request
            self._evict_sessions_for(need, freeing, keep=None if lend is None else lend[0])
        if not self.arena.can_admit(need, freeing) and self.preemption:
            self._preempt_for(best, now, freeing)
        if not self.arena.can_admit(need, freeing):
            return None
        self.waiting.remove(best)
        if lend is not None:
            slot, reused = self._lend(lend[0], best, need, lend[1], now), lend[1]
        else:
            # With contiguous slots the newcomer will join the decode batch: beside the running requests, no move then
            held = [s.slot for s in self.running if s.slot is not None]
            near = (min(held), max(held)) if self.contiguous_slots and held else None
            # KV computed under one adapter is another model's: prefix reuse stays within the adapter (and salt)
            slot, reused = self.arena.allocate(best, fill, need, max_reuse, namespace=best.cache_namespace,
                                               near=near)
        best.slot, best.computed = slot, reused
        if best.handle.metrics.scheduled is None:  # a re-admission reuses what it computed itself: not cached
            best.handle.metrics.prefix_reused_tokens = reused  # (usage's cached_tokens, as vLLM counts it)
            best.handle.metrics.scheduled = now
        best.status = Status.PREFILL if reused < len(fill) else Status.DECODE
        self.running.append(best)
        return best

    def _preempt_for(self, want: Sequence, now: float, freeing: list[int] | None = None) -> None:
        """Preempt running sequences of a lower class than ``want`` and ranked ≥ 1 below it after aging
        (lowest first), if that makes it fit. Aging lets a request through, it never lets it preempt a better class."""
        r = want.effective_rank(now, self.aging_s)
        victims = sorted((s for s in self.running
                          if s.rank > want.rank and s.effective_rank(now, self.aging_s) >= r + 1),
                         key=lambda s: (-s.effective_rank(now, self.aging_s), -s.arrival))
        freeing = freeing or []
        if not self.arena.can_admit(want.reserve_tokens, freeing=[*freeing, *(v.slot for v in victims)]):
            return
        for v in victims:
            if self.arena.can_admit(want.reserve_tokens, freeing):
                break
            self.running.remove(v)
            self._release(v)
            v.status = Status.WAITING
            v.handle.metrics.preemptions += 1
            self.preemptions += 1
            self.waiting.append(v)
