"""``GET /v1/responses/{id}/input_items`` (the SDK's ``responses.input_items.list``): a kept response's input as
OpenAI lists it, items with ids, in pages.

The items are the request's own ``input`` (not the earlier turns a ``previous_response_id`` continued: those are
their own responses' input items), each in the SDK's ``ResponseItem`` shape: a string input is one user message,
messages hold their text as ``input_text`` parts (the assistant's as ``output_text``), ``function_call`` /
``function_call_output`` items are as sent; an item sent without an ``id`` gets one here, once, when the response is
made, so the pages of one listing agree.
"""

from __future__ import annotations

import uuid
from typing import Any

from lineside.server.errors import APIError

MAX_LIMIT = 100  # OpenAI's: limit is 1..100, default 20


def _text_parts(content: Any, kind: str) -> list[dict[str, Any]]:
    parts = [{"type": kind, "text": content}] if isinstance(content, str) else [
        {"type": kind, "text": p.get("text", "")} for p in content or () if isinstance(p, dict)]
    return [{**p, "annotations": []} if kind == "output_text" else p for p in parts]


def _item(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        assistant = role == "assistant"
        return {"type": "message", "id": item.get("id") or "msg_" + uuid.uuid4().hex, "role": role,
                "status": item.get("status") or "completed",
                "content": _text_parts(item.get("content"), "output_text" if assistant else "input_text")}
    prefix = {"function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}.get(kind, "item_")
    return {**item, "id": item.get("id") or prefix + uuid.uuid4().hex, "status": item.get("status") or "completed"}


def input_items(given: str | list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """A request's ``input`` (already checked by responses_api.input_messages) as its listed items, in order."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    return tuple(_item(i) for i in given)


def page(items: tuple[dict[str, Any], ...], *, after: str | None, limit: int, order: str) -> dict[str, Any]:
    """One page of ``items`` (OpenAI's list object); each bad query parameter a 400 naming it."""
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: {order!r} is not 'asc' or 'desc'", "invalid_value", param="order")
    if not 1 <= limit <= MAX_LIMIT:
        raise APIError(400, f"limit: {limit} is not between 1 and {MAX_LIMIT}", "invalid_value", param="limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [i["id"] for i in ordered]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response", "invalid_value", param="after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
