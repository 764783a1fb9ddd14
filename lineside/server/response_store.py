"""The responses ``/v1/responses`` keeps (``store``, on unless the request says false), so that a later request
can continue one with ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}`` find it.

What is kept is the conversation as chat messages (the earlier turns' input and output, without their
``instructions``: OpenAI does not carry those over), not KV: the next turn's prompt starts with the same
tokens, so the engine's prefix cache reuses their KV where it still holds it. Held in memory, least recently
used dropped past ``capacity`` (a restart forgets them, as vLLM's store does).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """One finished response: its body as it was answered, the conversation up to and including its output, and its
    request's input as ``input_items`` lists it (response_items.py)."""

    body: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    input_items: tuple[dict[str, Any], ...] = ()


class ResponseStore:
    """Responses by id, at most ``capacity`` of them (0: none kept; ``previous_response_id`` then finds nothing)."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._by_id[response_id] = stored
        self._by_id.move_to_end(response_id)
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, marked recently used; None when it was never kept, was dropped or deleted."""
        stored = self._by_id.get(response_id)
        if stored is not None:
            self._by_id.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._by_id.pop(response_id, None) is not None
