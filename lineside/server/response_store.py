"""The responses ``/v1/responses`` keeps (``store``, on unless the request says false), so that a later request
can continue one with ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}`` find it.

What is kept is the conversation as chat messages (the earlier turns' input and output, without their
``instructions``: OpenAI does not carry those over), not KV: the next turn's prompt starts with the same
tokens, so the engine's prefix cache reuses their KV where it still holds it. Held in memory, least recently
used dropped past ``capacity`` responses or ``max_bytes`` of JSON (a restart forgets them, as vLLM's store does):
a count alone let a few long answers with ``top_logprobs`` (~0.6 MB of JSON, ~2 MB as Python objects, per 450
tokens) take gigabytes on a server that runs for weeks.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

DEFAULT_STORED_RESPONSES_MB = 64


def _json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


class StoredResponse:
    """One finished response: its body as it was answered (kept as compact JSON: a quarter of the memory its dicts
    take), the conversation up to and including its output, and its request's input as ``input_items`` lists it
    (response_items.py)."""

    __slots__ = ("_body", "status", "conversation", "input_items", "size")

    def __init__(self, body: dict[str, Any], conversation: tuple[dict[str, Any], ...],
                 input_items: tuple[dict[str, Any], ...] = ()):
        self._body = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        self.status: str = str(body.get("status", ""))
        self.conversation = conversation
        self.input_items = input_items
        # what it holds, as JSON bytes (the conversation counted whole, though a chain's turns share their messages)
        self.size = len(self._body) + _json_size(conversation) + _json_size(input_items)

    @property
    def body(self) -> dict[str, Any]:
        """The body as it was answered (a fresh copy each time)."""
        return json.loads(self._body)


class ResponseStore:
    """Responses by id, at most ``capacity`` of them and ``max_bytes`` of their JSON (0 responses: none kept;
    ``previous_response_id`` then finds nothing). The newest one is kept whatever its size, so an answer that says
    ``store: true`` can always be continued right after."""

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_STORED_RESPONSES_MB << 20):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0  # the JSON bytes of what is held
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self.delete(response_id)
        self._by_id[response_id] = stored
        self.bytes += stored.size
        while len(self._by_id) > self.capacity or (self.bytes > self.max_bytes and len(self._by_id) > 1):
            _, dropped = self._by_id.popitem(last=False)
            self.bytes -= dropped.size

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, marked recently used; None when it was never kept, was dropped or deleted."""
        stored = self._by_id.get(response_id)
        if stored is not None:
            self._by_id.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._by_id.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True
