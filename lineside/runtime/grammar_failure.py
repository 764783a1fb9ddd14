"""What a grammar that took no sampled token means for its request: one place that both the serving engine
(sequence.py) and the offline Generator read, so `lineside generate`'s library path and the server say the same."""

from __future__ import annotations

from dataclasses import dataclass

from lineside.runtime.structured import (
    Constraint,
    dead_end_message,
    is_dead_end,
    is_limit_error,
    limit_message,
)
from lineside.strenum import StrEnum


class GrammarErrorCode(StrEnum):
    """The OpenAI error code a request's own grammar ends it with (an HTTP 400, invalid_request_error)."""

    TOO_LARGE = "grammar_too_large"
    DEAD_END = "grammar_dead_end"


@dataclass(frozen=True)
class GrammarFailure:
    """The one line a rejected token ends a request with; ``code`` None: the engine failed, not the request's
    grammar. ``param``: the request field that carried the grammar (None when it came from no field)."""

    message: str
    code: GrammarErrorCode | None
    param: str | None

    @property
    def client_error(self) -> bool:
        return self.code is not None


def grammar_failure(c: Constraint | None, tok: int, why: str | None) -> GrammarFailure:
    """Past the grammar engine's limits or at text this vocabulary cannot spell, it is the grammar's fault, named
    after its field; any other rejection is the engine's own failure."""
    param = (c.param or None) if c is not None else None
    if c is not None and is_limit_error(why):
        return GrammarFailure(limit_message(c, why or ""), GrammarErrorCode.TOO_LARGE, param)
    if c is not None and is_dead_end(why):
        return GrammarFailure(dead_end_message(c, why or ""), GrammarErrorCode.DEAD_END, param)
    return GrammarFailure(f"grammar rejected token {tok}: {why}", None, param)
