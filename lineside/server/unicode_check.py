"""Refuse a request whose strings are not valid Unicode, wherever they are.

A JSON escape such as ``\\ud800`` parses to a lone surrogate: a Python str that cannot be encoded as UTF-8, so
the tokenizer, the chat template's output or the grammar compiler fail on it deep inside (a 500). Message
contents are checked where they are cleaned (``request_mapping.clean_text``); this walks every other field
(tool definitions, tool-call arguments, names, stop strings, template variables) once, before any of them is
used, and answers the same one-line 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from lineside.server.errors import APIError


def _surrogate_at(value: Any, path: tuple[str, ...]) -> tuple[str, ...] | None:
    """Where the first string that is not valid Unicode lies in ``value`` (None: nowhere)."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, BaseModel):
        items: Any = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        key_path = (*path, str(key))
        if isinstance(key, str) and _surrogate_at(key, key_path) is not None:
            return key_path
        found = _surrogate_at(item, key_path)
        if found is not None:
            return found
    return None


def check_unicode(body: BaseModel) -> None:
    """400 invalid_utf8 naming the first field (``tools.0.function.description``) that holds a lone surrogate."""
    found = _surrogate_at(body, ())
    if found is not None:
        param = ".".join(found)
        raise APIError(400, f"'{param}' is not valid UTF-8 (it contains a lone surrogate escape); send valid "
                            "Unicode text", "invalid_utf8", param=param)
