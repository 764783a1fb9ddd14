"""String formats narrowed to what clients' parsers read, before a schema is compiled.

The grammar engine's ``date-time`` and ``time`` follow RFC 3339's grammar, which allows a leap second (``:60``) in
any minute; Python's datetime, pydantic (OpenAI's ``.parse()``) and JavaScript's Date refuse it, and the JSON Schema
test suite allows it only at 23:59:60 UTC. A pattern beside the format keeps the seconds at 00-59: a subset of the
format, so every answer still validates.
"""

from __future__ import annotations

from typing import Any

# the seconds' first digit sits at a fixed place: "YYYY-MM-DDTHH:MM:" and "HH:MM:"
SECONDS_PATTERNS = {"date-time": "^.{17}[0-5].*$", "time": "^.{6}[0-5].*$"}
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})  # values, not subschemas


def no_leap_seconds(schema: Any) -> Any:
    """``schema`` (a copy the caller owns: changed in place and returned) with every ``date-time`` / ``time``
    string kept off second 60; a pattern already there is kept, the new one joining it through ``allOf``."""
    todo = [schema]
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            pattern = SECONDS_PATTERNS.get(v.get("format")) if isinstance(v.get("format"), str) else None
            t = v.get("type", "string")
            if pattern is not None and (t == "string" or isinstance(t, list) and "string" in t):
                if "pattern" not in v:
                    v["pattern"] = pattern
                elif isinstance(v.get("allOf", []), list):
                    v["allOf"] = [*v.get("allOf", []), {"pattern": pattern}]
            todo.extend(s for k, s in v.items() if k not in _DATA_KEYS)
    return schema
