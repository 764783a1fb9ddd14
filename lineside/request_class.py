"""A request's class (X-Priority, X-Mode) carried past a gateway in the W3C ``tracestate`` header.

Gateways forward only some headers: SMG passes ``tracestate`` (tracing context is meant to cross every hop)
but not X-Priority or X-Mode. So the fleet front writes a ``lineside=priority:high;mode:batch`` member and
`lineside serve` reads it when the request has no X-Priority / X-Mode of its own (W3C Trace Context §3.3).
"""

from __future__ import annotations

TRACESTATE_KEY = "lineside"
_FIELDS = ("priority", "mode")


def tracestate_member(*, priority: str | None, mode: str | None) -> str | None:
    """The ``lineside=...`` list member for these values (None when there is nothing to carry)."""
    parts = [f"{k}:{v}" for k, v in zip(_FIELDS, (priority, mode), strict=True) if v]
    return f"{TRACESTATE_KEY}={';'.join(parts)}" if parts else None


def with_member(tracestate: str | None, member: str | None) -> str | None:
    """``tracestate`` with our member first and any earlier ``lineside`` member dropped (a client cannot
    smuggle its own past the front); the other vendors' members are kept in order."""
    others = [m.strip() for m in (tracestate or "").split(",")
              if m.strip() and m.split("=", 1)[0].strip() != TRACESTATE_KEY]
    members = ([member] if member else []) + others
    return ",".join(members[:32]) or None  # the spec's limit: 32 members


def read_member(tracestate: str | None) -> dict[str, str]:
    """{"priority": ..., "mode": ...} from the ``lineside`` member of a tracestate value (lower-cased; only
    the fields present). Malformed parts are ignored, as tracing headers are advisory."""
    for m in (tracestate or "").split(","):
        key, _, value = m.strip().partition("=")
        if key.strip() != TRACESTATE_KEY:
            continue
        out = {}
        for part in value.split(";"):
            k, _, v = part.partition(":")
            if k.strip() in _FIELDS and v.strip():
                out[k.strip()] = v.strip().lower()
        return out
    return {}
