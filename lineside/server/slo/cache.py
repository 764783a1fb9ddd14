"""The level-2 response cache: whole non-streamed answers to exact repeats (same model, endpoint, n, engine
requests but for their ids and scheduling, and output options), only when the answer is reproducible (greedy or
seeded) and no prefill session is involved.

Bounded (least recently used goes first) and every entry expires after its TTL on an injected clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import fields
from typing import Any

from lineside.runtime.request import GenerationRequest
from lineside.runtime.sampling import SamplingParams

# The GenerationRequest fields that do not change the answer: who asked, when it is due, how it is scheduled.
# Every other field is keyed (prompt ids, max_tokens, sampling with its seed and min_tokens, stop strings and
# stop_token_ids, ignore_eos, the constraint, logprobs, speculation, the adapter, and any field added later).
UNKEYED_FIELDS = frozenset({"request_id", "priority", "mode", "timeout_s"})


def reproducible(sampling: SamplingParams) -> bool:
    """Greedy decoding or a fixed seed: the same request gives the same answer, so a cached one is honest."""
    return sampling.seed is not None or not sampling.temperature


def cacheable(req: GenerationRequest) -> bool:
    """Reproducible, and bound to no prefill session (an answer from the cache would not keep its KV)."""
    return reproducible(req.sampling) and req.session_id is None


def request_key(req: GenerationRequest) -> str:
    """What the engine is asked, every field but ``UNKEYED_FIELDS`` (the values' reprs: lists and dataclasses)."""
    return repr(tuple((f.name, getattr(req, f.name)) for f in fields(req) if f.name not in UNKEYED_FIELDS))


def cache_key(*, model: str, endpoint: str, requests: Sequence[GenerationRequest], n: int,
              output: str = "") -> Hashable:
    """``requests``: the first choice's engine request for each prompt (the n copies differ by seed + copy);
    ``output``: how the answer is written from the tokens (tool calls, logprobs)."""
    return (model, endpoint, n, tuple(request_key(r) for r in requests), output)


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
