"""JSON Schema ``format`` values the grammar engine cannot enforce, left out of a schema before it is compiled.

JSON Schema makes ``format`` an annotation (validators ignore a format they do not know), and the schemas clients
send carry many: pydantic writes ``"binary"`` for bytes, ``"password"`` for SecretStr, ``"path"`` for Path,
OpenAPI-derived tools ``"int64"`` / ``"byte"``. llguidance refused each as "Unknown format", a 400 for a valid
schema (LangChain's with_structured_output or instructor over a model with a bytes field); vLLM's default
backend ignores them. The formats it enforces are kept.
"""

from __future__ import annotations

import json
from typing import Any

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
