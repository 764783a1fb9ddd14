"""The scheduler's part for prefill sessions: their slots, their chunks, lending and taking back their KV.

Mixed into ``Scheduler`` (the one owner of slots): requests always come first. A session gets a slot only when
no request is waiting; its chunks run only in steps without a request's prefill chunk, and while requests
decode in at most one step in ``session_every``, ``session_busy_chunk`` tokens at a time (a CPU has no idle
compute beside a decode step: spacing small chunks keeps most gaps between tokens untouched and the others short). When a
request does not fit, idle sessions are released first, least recently used first — a session never
preempts or fails a running request. A completion that names the session and whose prompt extends its KV
takes the session's slot as its own (no copy); when it ends, the slot's prefill-written KV goes back to the
session if the completion asked to keep it (the next turn), else the session ends with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lineside.runtime.kv_manager import Namespace
from lineside.runtime.sequence import SequenceStatus
from lineside.runtime.sessions import PrefillSession, SessionInfo, SessionStore, common_prefix
from lineside.runtime.step_plan import SessionChunk, StepPlan, prefill_take

if TYPE_CHECKING:
    from lineside.runtime.kv_manager import KVCacheArena
    from lineside.runtime.sequence import Sequence


class SessionSlots:
    """Needs ``arena``, ``waiting``, ``running``, ``prefill_chunk`` and ``contiguous_slots`` from the Scheduler."""

    arena: KVCacheArena
    waiting: list[Sequence]
    running: list[Sequence]
    prefill_chunk: int
    contiguous_slots: bool
    sessions: SessionStore | None
    session_every: int
    session_busy_chunk: int
    _quiet_steps: int

    # ---- what the engine calls (under its state lock, between steps) ---------------------------
    def update_session(self, session_id: str, target: list[int], prompt_tokens: int, now: float,
                       rank: int = 1, namespace: Namespace = "") -> SessionInfo:
        """Set what ``session_id`` should cache: its KV up to the first differing token is kept, the rest is
        pending; under another ``namespace`` (cache_salt) none is kept. Raises SessionLimitError for a new session
        past the cap."""
        assert self.sessions is not None
        s = self.sessions.open(session_id, now, rank)
        s.rank, s.prompt_tokens = rank, prompt_tokens
        s.touch(now)
        if s.namespace != namespace:  # KV computed under another salt is not this prompt's to reuse
            s.namespace, s.target = namespace, []
            if s.slot is not None:  # a slot of the new namespace is given when it has work (_place_sessions)
                self.arena.truncate(s.slot, 0)
                self.arena.free(s.slot)
                s.slot, s.computed = None, 0
        if len(target) < 2:
            target = []  # one token is never prefilled alone, and not worth a slot
        keep = common_prefix(s.target, target)
        s.target, s.updated = list(target), now
        if s.computed > keep:
            s.computed = keep
            if s.slot is not None:
                self.arena.truncate(s.slot, keep)
        return s.info(now)

    def release_session(self, s: PrefillSession, *, evicted: bool = False, expired: bool = False) -> None:
        """End a session; its slot's KV stays in the prefix cache until the slot is given out again."""
        assert self.sessions is not None
        if s.slot is not None and self.arena.owner[s.slot] is s:
            self.arena.truncate(s.slot, s.computed)
            self.arena.free(s.slot)
        s.slot = None
        self.sessions.drop(s)
        self.sessions.evicted += evicted
        self.sessions.expired += expired

    def expire_sessions(self, now: float) -> int:
        if self.sessions is None:
            return 0
        due = self.sessions.due(now)
        for s in due:
            self.release_session(s, expired=True)
        return len(due)

    def session_pinned_blocks(self) -> int:
        a = self.arena
        return sum(a.blocks_for(len(a.tokens[i])) for i, o in enumerate(a.owner) if isinstance(o, PrefillSession))

    # ---- scheduling -----------------------------------------------------------------------------------
    def _lendable(self, seq: Sequence, fill_len: int, max_reuse: int) -> tuple[PrefillSession, int] | None:
        """The session ``seq`` names and how many of its prompt tokens that session's KV supplies, when any."""
        if self.sessions is None or seq.req.session_id is None:
            return None
        s = self.sessions.get(seq.req.session_id)
        if s is None or s.slot is None or s.lent_to is not None or s.namespace != seq.cache_namespace:
            return None  # (another cache_salt's KV is never lent)
        reuse = min(common_prefix(self.arena.tokens[s.slot][:s.computed], seq.prompt), max_reuse)
        if fill_len - reuse == 1 and fill_len > 1:
            reuse -= 1  # never leave a 1-token prefill (see the scheduler's ``single-token steps``)
        return (s, reuse) if reuse > 0 else None

    def _lend(self, s: PrefillSession, seq: Sequence, need: int, reuse: int, now: float) -> int:
        """Give the session's slot to ``seq`` with ``reuse`` positions of KV; returns the slot."""
        assert self.sessions is not None and s.slot is not None
        slot = s.slot
        self.arena.hand_over(slot, seq, need, reuse)
        s.slot, s.lent_to, s.lent_at = None, seq, now
        s.touch(now)
        self.sessions.hits += 1
        self.sessions.tokens_saved += reuse
        return slot

    def _evict_sessions_for(self, need: int, freeing: list[int], keep: PrefillSession | None = None) -> None:
        """Release idle sessions, least recently used first, until ``need`` positions can be admitted."""
        if self.sessions is None:
            return
        for s in self.sessions.lru():
            if self.arena.can_admit(need, freeing):
                return
            if s is not keep:
                self.release_session(s, evicted=True)

    def _session_done(self, seq: Sequence, now: float) -> None:
        """``seq`` has ended and still holds its slot: the session it named keeps that slot's prefill-written KV
        (asked with keep_session, or a prefill came for the session meanwhile) or ends with it."""
        if self.sessions is None or seq.req.session_id is None:
            return
        s = self.sessions.get(seq.req.session_id)
        if seq.req.adapter is not None:  # a session holds base-model KV: an adapter's never becomes (or replaces) it
            if s is not None and not seq.req.keep_session and s.lent_to is None and s.updated <= seq.arrival:
                self.release_session(s)  # ... but the session it named ends with it, as after a base completion
            return
        keep = seq.req.keep_session and not seq.session_deleted  # a DELETE since it came ends the session for good
        mine = s is not None and s.lent_to is seq
        if seq.slot is None:  # it holds no KV now (ended while preempted)
            if mine:
                self.release_session(s)
            return
        if s is None:
            if not keep:
                return
            if len(self.sessions) >= self.sessions.max_sessions:
                # at the cap the answer's KV replaces the least recently used idle session, as keep_session asked
                # (dropping it unseen left the client's next turn to recompute); every session in use: not kept
                idle = self.sessions.idlest()
                if idle is None:
                    return
                self.release_session(idle, evicted=True)
            s = self.sessions.open(seq.req.session_id, now, seq.rank)
            s.updated = -float("inf")
        elif s.lent_to is not None and not mine:
            return  # another request holds the session: it decides
        since = s.lent_at if mine else seq.arrival
        newer = s.updated > since  # a prefill call came after this request started: its target stands
        if not (keep or newer):
            if mine or s.updated <= since:
                self.release_session(s)
            return
        if newer and s.namespace != seq.cache_namespace:
            return  # a prefill under another cache_salt came meanwhile: this KV is not what it caches
        if s.slot is not None:  # a fallback completion keeps its own slot: the session's older one goes
            old, s.slot = s.slot, None
            self.arena.truncate(old, s.computed)
            self.arena.free(old)
        slot = seq.slot
        kept = list(self.arena.tokens[slot][:min(self.arena.shared[slot], seq.computed)])
        target = s.target if newer else kept
        computed = common_prefix(kept, target)
        self.arena.hand_over(slot, s, len(target), computed)
        s.slot, s.lent_to, s.target, s.computed = slot, None, list(target), computed
        s.namespace = seq.cache_namespace
        if not newer:  # it now caches this completion's prompt (a newer prefill's count stands)
            s.prompt_tokens = len(seq.prompt)
        s.touch(now)
        seq.slot = None

    def _place_sessions(self, now: float) -> None:
        """Give a slot to sessions with pending work that lack one, while no request waits for it."""
        if self.sessions is None or self.waiting:
            return
        # with contiguous slots the last free slot stays free while a prefill is under way: one that sits in the
        # decode range when another ends moves out through it (``_compact``)
        keep = self.contiguous_slots and any(s.status == SequenceStatus.PREFILL for s in self.running)
        want = sorted((s for s in self.sessions.by_id.values()
                       if s.slot is None and s.lent_to is None and s.pending >= 1),
                      key=lambda s: (s.rank, s.updated))
        for s in want:
            if keep and self.arena.free_slots <= 1:
                return
            for old in self.sessions.lru():  # make room from sessions used less recently than this one
                if self.arena.can_admit(len(s.target)) or old.last_used >= s.last_used:
                    break
                self.release_session(old, evicted=True)
            if not self.arena.can_admit(len(s.target)):
                return
            slot, reuse = self.arena.allocate(s, s.target, len(s.target), len(s.target),  # the least valuable
                                              namespace=s.namespace)  # slot
            s.slot, s.computed = slot, reuse

    def _session_chunk(self, plan: StepPlan) -> None:
        """Plan a session chunk into a step that has no request prefill chunk (see the module docstring)."""
        if self.sessions is None or plan.prefills:
            return
        busy = bool(plan.decode)
        self._quiet_steps += 1
        if busy and self._quiet_steps < self.session_every:
            return
        ready = [s for s in self.sessions.by_id.values() if s.slot is not None and s.lent_to is None and s.pending]
        if not ready:
            return
        s = min(ready, key=lambda s: (s.rank, s.updated))
        if s.pending == 1:  # never a 1-token chunk: recompute the token before it too (same KV, multi-token path)
            s.computed -= 1
            self.arena.truncate(s.slot, s.computed)
        size = min(self.session_busy_chunk, self.prefill_chunk) if busy else self.prefill_chunk
        take = prefill_take(s.pending, size)
        a, slot = self.arena, s.slot
        assert slot is not None
        grown = max(a.reserved[slot], a.blocks_for(s.computed + take))
        if a.reserved_blocks - a.reserved[slot] + grown > a.total_blocks:
            return  # the arena is full: it waits for a release (requests never wait for a session)
        a.reserved[slot] = grown
        plan.session = SessionChunk(s, s.slot, s.computed, s.target[s.computed:s.computed + take])
        self._quiet_steps = 0

    def _session_applied(self, plan: StepPlan, error: str | None) -> None:
        """Record a session chunk's KV, if the session still wants exactly those tokens there."""
        sc = plan.session
        if sc is None or self.sessions is None:
            return
        s = sc.session
        if error is not None:
            if s.alive:
                self.release_session(s)
            return
        n = len(sc.tokens)
        if s.alive and s.slot == sc.slot and s.computed == sc.start and s.target[sc.start:sc.start + n] == sc.tokens:
            self.arena.append(sc.slot, sc.tokens, shareable=n > 1)
            s.computed += n
            self.sessions.prefill_tokens += n
