"""Prefill sessions: a prompt still being written, whose KV the engine computes in idle capacity.

A session names the tokens a client wants cached (``target``: the stable prefix of its latest prefill)
and, once it holds one, a slot of the KV arena that it pins (``arena.owner[slot]`` is the session), in
which the first ``computed`` target tokens' KV is valid. The scheduler is the one that moves a session's
slot (gives it one, computes its chunks, lends it to the completion that extends it, takes it back for
the next turn, releases it); this module is the table of sessions and the rules on it: the cap, the
TTL refreshed by every use, LRU order for release under memory pressure, and the counters /metrics shows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lineside.errors import LinesideError
from lineside.runtime.kv_manager import Namespace

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
SESSION_ID_RULE = "1-128 characters: letters, digits and . _ : - (starting with a letter or digit)"


class SessionLimitError(LinesideError):
    """The engine already holds ``max_sessions`` sessions: the server answers 429."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SessionsUnsupported(LinesideError):
    """This model's decode state cannot be kept as a session (the server answers 400)."""


def check_session_id(session_id: Any) -> str:
    """The id as given, or a LinesideError naming the rule (the server's 400 ``invalid_session_id``)."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):  # match: "$" passes a last \n
        shown = repr(session_id)[:60]
        raise LinesideError(f"session_id {shown} is not a valid session id; use {SESSION_ID_RULE}")
    return session_id


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class SessionInfo:
    """What a prefill call answers and GET /v1/prefill/{id} shows."""

    session_id: str
    cached_tokens: int  # target tokens whose KV is computed and pinned
    pending_tokens: int  # target tokens still to compute
    prompt_tokens: int  # tokens of the whole prompt sent (the unstable tail is never cached)
    expires_in_s: float


class PrefillSession:
    """One session's state; only the scheduler and SessionStore change it."""

    def __init__(self, session_id: str, now: float, ttl_s: float, rank: int = 1):
        self.session_id = session_id
        self.target: list[int] = []  # tokens the client wants cached
        self.prompt_tokens = 0
        self.computed = 0  # leading target tokens whose KV is in ``slot``
        self.slot: int | None = None  # pinned arena slot; None while waiting for one or lent to a request
        self.lent_to: Any = None  # the Sequence using this session's slot, while it runs
        self.lent_at = now
        self.rank = rank  # its prefill call's priority: higher-priority sessions compute first
        self.ttl_s = ttl_s
        self.last_used = now
        self.updated = now  # when its target last changed (older pending work computes first)
        self.expires_at = now + ttl_s
        self.alive = True
        self.namespace: Namespace = ""  # the cache_salt its KV was computed under (kv_manager.salted); lent only within it

    @property
    def pending(self) -> int:
        return max(0, len(self.target) - self.computed)

    def touch(self, now: float) -> None:
        self.last_used = now
        self.expires_at = now + self.ttl_s

    def info(self, now: float) -> SessionInfo:
        return SessionInfo(self.session_id, self.computed, self.pending, self.prompt_tokens,
                           max(0.0, self.expires_at - now))


class SessionStore:
    """The sessions by id, with the cap and the counters; the scheduler owns the store and their slots."""

    def __init__(self, ttl_s: float = 30.0, max_sessions: int = 64):
        if ttl_s <= 0:
            raise LinesideError(f"session TTL must be > 0 seconds, got {ttl_s}")
        if max_sessions < 0:
            raise LinesideError(f"max_sessions must be ≥ 0, got {max_sessions}")
        self.ttl_s, self.max_sessions = float(ttl_s), int(max_sessions)
        self.by_id: dict[str, PrefillSession] = {}
        self.hits = 0  # completions that started from a session's KV
        self.tokens_saved = 0  # prompt tokens those completions did not compute
        self.prefill_tokens = 0  # tokens computed by session chunks
        self.expired = 0
        self.evicted = 0  # released early because running requests needed the memory

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, session_id: str | None) -> PrefillSession | None:
        return self.by_id.get(session_id) if session_id else None

    def open(self, session_id: str, now: float, rank: int = 1) -> PrefillSession:
        """The session named, made if it is new (SessionLimitError at the cap)."""
        s = self.by_id.get(session_id)
        if s is not None:
            return s
        if len(self.by_id) >= self.max_sessions:
            # one lent to a running request never expires while it runs (even past its TTL): the soonest any
            # other can; with none, a TTL (a lent one is kept for one more, or ends, when its request does)
            soonest = self.next_expiry()
            soonest = now + self.ttl_s if soonest is None else soonest
            raise SessionLimitError(f"the server already holds {self.max_sessions} prefill sessions (the limit); "
                                    "finish or delete one, or retry when one expires", max(0.0, soonest - now))
        s = self.by_id[session_id] = PrefillSession(session_id, now, self.ttl_s, rank)
        return s

    def drop(self, session: PrefillSession) -> None:
        session.alive = False
        if self.by_id.get(session.session_id) is session:
            del self.by_id[session.session_id]

    def due(self, now: float) -> list[PrefillSession]:
        """Sessions past their TTL and not lent to a running request."""
        return [s for s in self.by_id.values() if now >= s.expires_at and s.lent_to is None]

    def lru(self) -> list[PrefillSession]:
        """Sessions holding a slot that no request is using, least recently used first."""
        return sorted((s for s in self.by_id.values() if s.slot is not None and s.lent_to is None),
                      key=lambda s: s.last_used)

    def idlest(self) -> PrefillSession | None:
        """The least recently used session no running request holds (None when each is lent): the one a new kept
        session replaces at the cap, as a prefix cache drops its least recently used entry."""
        return min((s for s in self.by_id.values() if s.lent_to is None), key=lambda s: s.last_used, default=None)

    def next_expiry(self) -> float | None:
        return min((s.expires_at for s in self.by_id.values() if s.lent_to is None), default=None)
