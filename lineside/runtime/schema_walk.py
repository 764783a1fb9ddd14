"""Walking a JSON schema's subschemas without recursion: schemas nest past Python's stack (a body parser takes a few
hundred levels), and the rewrites before a compile each walk all of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})  # values, not subschemas


def schema_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object in ``schema`` that may be a subschema, the root first; a data keyword's value is not walked
    into. A node may be changed in place when it is yielded: its entries are read after."""
    todo = [schema]
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            yield v
            todo.extend(s for k, s in v.items() if k not in DATA_KEYS)
