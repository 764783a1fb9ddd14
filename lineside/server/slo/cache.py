"""The level-2 response cache: whole non-streamed answers to exact repeats (same model, endpoint, n, engine
requests but for their ids and scheduling, and output options), only when the answer is reproducible (greedy or
seeded) and no prefill session is involved.

Bounded by entries and by the bytes of the answers' JSON (least recently used goes first; an answer bigger than
the whole byte bound is not kept), as the responses store is: a count alone let 512 long answers with
``top_logprobs`` (~0.6 MB of JSON, ~2 MB as Python objects, each) take a gigabyte. Answers are held as compact JSON (a quarter of the
memory their dicts take) and every entry expires after its TTL on an injected clock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import fields
from typing import Any, NamedTuple

from lineside.runtime.request import GenerationRequest
from lineside.runtime.sampling import SamplingParams

DEFAULT_CACHE_MB = 64  # the byte bound's default, as the responses store's

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


class _Entry(NamedTuple):
    stored_at: float
    body: bytes  # the answer as compact UTF-8 JSON


class ResponseCache:
    """key → (stored at, body as JSON), at most ``max_entries`` of them and ``max_bytes`` of their JSON; ``get``
    counts hits and misses for /metrics."""

    def __init__(self, *, max_entries: int, ttl_s: float, clock: Callable[[], float],
                 max_bytes: int = DEFAULT_CACHE_MB << 20):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.bytes = 0  # the JSON bytes of what is held
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, body: dict[str, Any]) -> None:
        """Keep ``body`` for ``key`` (replacing what was), dropping the least recently used past the bounds; an
        answer bigger than ``max_bytes`` alone is not kept (nor is the older one for its key)."""
        self._drop(key)
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) > self.max_bytes:
            return
        self._entries[key] = _Entry(self.clock(), data)
        self.bytes += len(data)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self.bytes -= len(self._entries.popitem(last=False)[1].body)

    def get(self, key: Hashable) -> dict[str, Any] | None:
        """The answer kept for ``key`` (a fresh copy), marked recently used; None when absent or expired."""
        entry = self._entries.get(key)
        if entry is not None and self.clock() - entry.stored_at > self.ttl_s:
            self._drop(key)
            entry = None
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return json.loads(entry.body)

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= len(entry.body)
