"""The level-2 response cache: whole non-streamed answers to exact repeats (same model, endpoint, prompt ids,
sampling, seed, budget, stops and n), only when the answer is reproducible (greedy or seeded).

Bounded (least recently used goes first) and every entry expires after its TTL on an injected clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from lineside.runtime.sampling import SamplingParams


def reproducible(sampling: SamplingParams) -> bool:
    """Greedy decoding or a fixed seed: the same request gives the same answer, so a cached one is honest."""
    return sampling.seed is not None or not sampling.temperature


def cache_key(*, model: str, endpoint: str, prompts: list[list[int]], sampling: SamplingParams,
              budgets: list[int], stops: list[str], n: int) -> Hashable:
    return (model, endpoint, tuple(tuple(ids) for ids in prompts), repr(sampling), tuple(budgets),
            tuple(stops), n)


class ResponseCache:
    """key → (stored at, body); ``get`` counts hits and misses for /metrics."""

    def __init__(self, *, max_entries: int, ttl_s: float, clock: Callable[[], float]):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[Hashable, tuple[float, dict[str, Any]]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, body: dict[str, Any]) -> None:
        self._entries[key] = (self.clock(), body)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key: Hashable) -> dict[str, Any] | None:
        entry = self._entries.get(key)
        if entry is not None and self.clock() - entry[0] > self.ttl_s:
            del self._entries[key]
            entry = None
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]
