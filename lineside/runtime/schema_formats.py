"""String formats narrowed to what the grammar engine enforces and clients' parsers read, before a schema is compiled.

JSON Schema makes ``format`` an annotation (validators ignore a format they do not know), and the schemas clients
send carry many: pydantic writes ``"binary"`` for bytes, ``"password"`` for SecretStr, ``"path"`` for Path,
OpenAPI-derived tools ``"int64"`` / ``"byte"``. llguidance refused each as "Unknown format", a 400 for a valid
schema (LangChain's with_structured_output or instructor over a model with a bytes field); vLLM's default
backend ignores them. So a format outside ENFORCED_FORMATS is left out.

The grammar engine's ``date-time`` and ``time`` follow RFC 3339's grammar, which allows a leap second (``:60``) in
any minute; Python's datetime, pydantic (OpenAI's ``.parse()``) and JavaScript's Date refuse it, and the JSON Schema
test suite allows it only at 23:59:60 UTC. A pattern beside the format keeps the seconds at 00-59: a subset of the
format, so every answer still validates.
"""

from __future__ import annotations

import json
from typing import Any

from lineside.runtime.schema_walk import schema_nodes

# the seconds' first digit sits at a fixed place: "YYYY-MM-DDTHH:MM:" and "HH:MM:"
SECONDS_PATTERNS = {"date-time": "^.{17}[0-5].*$", "time": "^.{6}[0-5].*$"}


def no_leap_seconds(schema: Any) -> Any:
    """``schema`` (a copy the caller owns: changed in place and returned) with every ``date-time`` / ``time``
    string kept off second 60; a pattern already there is kept, the new one joining it through ``allOf``."""
    for v in schema_nodes(schema):
        pattern = SECONDS_PATTERNS.get(v.get("format")) if isinstance(v.get("format"), str) else None
        t = v.get("type", "string")
        if pattern is not None and (t == "string" or isinstance(t, list) and "string" in t):
            if "pattern" not in v:
                v["pattern"] = pattern
            elif isinstance(v.get("allOf", []), list):
                v["allOf"] = [*v.get("allOf", []), {"pattern": pattern}]
    return schema


# the formats llguidance enforces (a test checks each compiles and that another does not)
ENFORCED_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                              "uri"})
_SUBSCHEMA = frozenset({"items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
                        "propertyNames", "unevaluatedItems", "unevaluatedProperties"})
_SUBSCHEMAS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})  # lists of schemas
_NAMED_SUBSCHEMAS = frozenset({"properties", "patternProperties", "dependentSchemas", "$defs", "definitions"})


def without_unenforced_formats(schema: Any) -> Any:
    """``schema`` (an object, or its JSON text) with every ``format`` outside ENFORCED_FORMATS removed from its
    subschemas; a property named "format" is a name and stays. Anything else comes back as given, for the
    constraint's own checks to refuse. Copies only what changes; walked without recursion (schemas nest deep)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError:
            return schema
        cleaned = without_unenforced_formats(parsed)
        return schema if cleaned is parsed else cleaned
    if not _has_unenforced(schema):
        return schema
    root = _copy(schema)
    todo: list[Any] = [root]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("format"), str) and node["format"] not in ENFORCED_FORMATS:
            del node["format"]
        for key, value in node.items():
            if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
                todo.extend(value.values())
            elif key in _SUBSCHEMAS and isinstance(value, list):
                todo.extend(value)
            elif key in _SUBSCHEMA:
                todo.append(value)
    return root


def _has_unenforced(schema: Any) -> bool:
    """Whether any dict in ``schema`` has a string ``format`` outside ENFORCED_FORMATS (a cheap first look: most
    schemas have none, and are compiled as sent)."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("format"), str) and node["format"] not in ENFORCED_FORMATS:
                return True
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return False


def _copy(value: Any) -> Any:
    """A copy of the JSON containers in ``value`` (its leaves shared), without recursion."""
    if not isinstance(value, (dict, list)):
        return value
    root: Any = dict(value) if isinstance(value, dict) else list(value)
    todo = [root]
    while todo:
        node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in list(items):
            if isinstance(child, (dict, list)):
                node[key] = dict(child) if isinstance(child, dict) else list(child)
                todo.append(node[key])
    return root
