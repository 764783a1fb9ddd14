"""Function tools on ``/v1/responses``, in the Responses API's shapes, over chat's tool calling (tool_calls.py).

Request ``tools`` are ``{"type": "function", "name", "description", "parameters", "strict"}`` (no ``"function"``
wrapper; hosted tool types such as web_search are a 400), a named ``tool_choice`` is ``{"type": "function", "name"}``.
Input items ``function_call`` / ``function_call_output`` become what chat's history carries (an assistant message's
``tool_calls``, a ``tool`` message), so the chat template renders them as it renders chat's; the model's calls come
back as ``function_call`` output items. ``strict`` is accepted: ``required`` and a named function are constrained to
the parameters' schema whatever it says, ``auto`` reads the arguments as the model wrote them (as chat's tools do).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lineside.server.errors import APIError
from lineside.server.tool_calls import (
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceKind,
    parse_tool_choice,
    parse_tools,
)


@dataclass(frozen=True)
class FunctionTools:
    """A request's functions and how it asks for them."""

    tools: list[Tool]
    choice: ToolChoice
    max_calls: int | None  # parallel_tool_calls false: 1

    @property
    def calling(self) -> bool:
        """Whether the model's output is read for calls (tools given and tool_choice not none)."""
        return bool(self.tools) and self.choice.kind != ToolChoiceKind.NONE


def function_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> FunctionTools:
    """The request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, each bad one a 400 naming it."""
    parsed = parse_tools(tools, flat=True)
    choice = parse_tool_choice(tool_choice, parsed, flat=True)
    return FunctionTools(parsed, choice, 1 if parallel_tool_calls is False else None)


def echoed_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The response's ``tools``: the request's functions as OpenAI's response lists them."""
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")} for t in tools or []]


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_value", param=param)


def _string(item: dict[str, Any], key: str, where: str, what: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}: give {what} as a string (got {type(value).__name__})", f"{where}.{key}")
    return value


def call_of(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` input item as a chat tool call (``{"id", "type", "function": {"name", "arguments"}}``)."""
    call_id = _string(item, "call_id", where, "the call's id (the call_id its output answers)")
    name = _string(item, "name", where, "the function's name")
    arguments = _string(item, "arguments", where, "the arguments as JSON text")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def result_of(item: dict[str, Any], where: str, known: Iterable[str]) -> dict[str, Any]:
    """A ``function_call_output`` input item as a chat ``tool`` message; its ``call_id`` must name a call made before
    it in the conversation (OpenAI's rule too: a result answering no call is a mistake in the client's loop)."""
    call_id = _string(item, "call_id", where, "the id of the call this output answers")
    if call_id not in set(known):
        raise _bad(f"{where}.call_id: no function_call with call_id {call_id!r} comes before this output in the "
                   "conversation; send the function_call item first (or continue its response with "
                   "previous_response_id)", f"{where}.call_id")
    text = text_of(item.get("output"), f"{where}.output", "the function's output")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def text_of(value: Any, where: str, what: str) -> str:
    """An input item's text: a string, or a list of text parts joined by newlines (as a chat message's parts are
    joined, request_mapping.chat_messages); any other part is a 400 naming it (this model reads text only)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{where}: give {what} as a string or a list of input_text parts (got {type(value).__name__})",
                   where)
    parts = []
    for j, p in enumerate(value):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise APIError(400, f"{where}[{j}]: {kind!r} parts are not supported; this model reads text only",
                           "unsupported_parameter", param=f"{where}[{j}].type")
        if not isinstance(p.get("text"), str):
            raise _bad(f"{where}[{j}].text: give the part's text as a string (got {type(p.get('text')).__name__})",
                       f"{where}[{j}].text")
        parts.append(p["text"])
    return "\n".join(parts)


def call_ids(messages: Iterable[dict[str, Any]]) -> list[str]:
    """The ids of the calls the assistant messages among ``messages`` made."""
    return [c.get("id") for m in messages for c in m.get("tool_calls") or () if isinstance(c, dict)]


def call_item(call: ToolCall, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A call as a ``function_call`` output item (``id`` the item's, ``call_id`` what its output answers)."""
    return {"type": "function_call", "id": item_id or "fc_" + uuid.uuid4().hex, "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


def assistant_turn(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    """The answer as the next turn's history reads it: chat's assistant message, with its calls."""
    if not calls:
        return {"role": "assistant", "content": content or ""}
    return {"role": "assistant", "content": content or "", "tool_calls": [c.openai() for c in calls]}
