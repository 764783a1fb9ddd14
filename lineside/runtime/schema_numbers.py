"""Number ranges the grammar engine gets wrong, rewritten into ranges it gets right, before a schema is compiled.

llguidance 1.9's range for a ``number`` whose exclusive bound is a whole number n, with its other bound less than
one away (``gt=0, le=0.5``, ``(-1.25, -1)``), lets the bare bound itself through: ``"0"`` for ``(0, 0.5]``,
``"-0"`` for ``(-0.5, 0)``; an answer no validator (nor pydantic) accepts. Such a bound is moved inward by
EPSILON, a sliver no model writes, so that every number the grammar allows is inside the client's range.
"""

from __future__ import annotations

from typing import Any

from lineside.runtime.schema_walk import schema_nodes

# How far a whole-number exclusive bound is moved inward (or half the range, when that is narrower): the numbers
# lost, (n, n + 1e-10), need ten decimals; a nearer bound still compiles to a small regular expression.
EPSILON = 1e-10


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _bounds(node: dict[str, Any], lower: bool) -> tuple[float | None, bool]:
    """(the lower or upper bound of ``node``, whether it is exclusive), draft 4's boolean form included; the
    tighter one where both the inclusive and the exclusive keyword are given."""
    inc_key, exc_key = ("minimum", "exclusiveMinimum") if lower else ("maximum", "exclusiveMaximum")
    inc, exc = _number(node.get(inc_key)), node.get(exc_key)
    if exc is True and inc is not None:  # draft 4: {"minimum": 0, "exclusiveMinimum": true}
        return inc, True
    exc = _number(exc)
    if exc is None or (inc is not None and (inc > exc if lower else inc < exc)):
        return inc, False
    return exc, True


def _allows_numbers(node: dict[str, Any]) -> bool:
    t = node.get("type")
    return t is None or t == "number" or (isinstance(t, list) and "number" in t)


def _fixed(node: dict[str, Any]) -> None:
    """Move ``node``'s whole-number exclusive bound inward when its other bound is less than one away."""
    lo, lo_exc = _bounds(node, lower=True)
    hi, hi_exc = _bounds(node, lower=False)
    if lo is None or hi is None or hi <= lo or hi - lo >= 1 or not _allows_numbers(node):
        return
    step = min(EPSILON, (hi - lo) / 2)
    if lo_exc and lo.is_integer() and lo + step > lo:
        node.pop("minimum", None)
        node["exclusiveMinimum"] = lo + step
    if hi_exc and hi.is_integer() and hi - step < hi:
        node.pop("maximum", None)
        node["exclusiveMaximum"] = hi - step


def fix_number_ranges(schema: Any) -> Any:
    """``schema`` (a copy the caller owns: changed in place and returned) with every number range the grammar engine
    would widen moved inward; walked without recursion, data values (enum, const, ...) left alone."""
    for v in schema_nodes(schema):
        if any(k in v for k in ("exclusiveMinimum", "exclusiveMaximum")):
            _fixed(v)
    return schema
