"""The SLO guard's part of serving one request (openai_api._serve calls it): route, level-2 cache lookup,
level-1 batch gate, the degraded header, and storing reproducible answers for later repeats."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi.responses import JSONResponse

from lineside.runtime.request import GenerationRequest, Mode, Priority
from lineside.server import constraints
from lineside.server.outputs import OutputOptions
from lineside.server.slo.cache import cache_key, cacheable
from lineside.server.slo.controller import Level
from lineside.server.slo.guard import Route, SloGuard

DEGRADED_HEADER = "X-Lineside-Degraded"


@dataclass
class SloPlan:
    route: Route
    key: Hashable | None  # set when the answer is reproducible and not streamed: it may be cached
    headers: dict[str, str] = field(default_factory=dict)
    cached: JSONResponse | None = None
    cached_usage: dict[str, int] = field(default_factory=dict)  # the cached answer's usage (its latency-log line)

    def note(self, record: Any) -> None:
        """The latency log's per-request fields: the level, the bundle that answered and whether it was the
        fallback (the guard's signals read the primary's requests only: guard.observe)."""
        record.extra["slo_level"] = int(self.route.level)
        record.extra["bundle"] = self.route.model
        record.extra["slo_fallback"] = self.route.fallback


async def plan(guard: SloGuard, body: Any, *, requests: list[GenerationRequest], output: OutputOptions | None,
               chat: bool, priority: Priority, mode: Mode, n: int, response_id: str, draining: Any,
               cache: bool = True, primary_only: bool = False,
               client_gone: Callable[[], Awaitable[object]] | None = None) -> SloPlan:
    """Route the request (``requests``: the first choice's engine request for each prompt); at level 2 answer an
    exact repeat from the cache (its own id and time, the cached answer's ``model``: the bundle that made it); at
    level 1 hold batch work for the primary at the gate. ``cache`` False: never from the cache, nor into it (the
    Responses API: its answers have another shape and are kept for ``previous_response_id`` under their own id).
    ``primary_only``: the fallback cannot serve it (a LoRA adapter), the rest of the ladder still applies.
    ``client_gone`` returns once the client disconnects: a request held at the gate then ends (ClientGone); a full
    gate refuses it (QueueFullError)."""
    tokens = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    # the largest id the fallback would read: the prompt's, and a logit_bias id (past its vocabulary the sampler
    # skips the bias, so the answer would silently differ from the primary's)
    top = max([max(r.prompt_ids) for r in requests if r.prompt_ids]
              + [t for r in requests for t, _ in r.sampling.logit_bias], default=-1)
    route = guard.route(mode=mode, priority=priority, tokens=tokens, top_token=top, primary_only=primary_only)
    headers = {DEGRADED_HEADER: str(int(route.level))} if route.level > Level.NORMAL else {}
    key = None
    if cache and not body.stream and all(cacheable(r) for r in requests):
        key = cache_key(model=body.model or "", endpoint="chat" if chat else "completions", requests=requests,
                        n=n, output=output_key(output))
    result = SloPlan(route, key, headers)
    if key is not None and route.level >= Level.FALLBACK:
        hit = guard.cached(key)
        if hit is not None:
            answer = {**hit, "id": response_id, "created": int(time.time())}
            result.cached = JSONResponse(answer, headers={**headers, "X-Lineside-Cache": "hit"})
            result.cached_usage = hit.get("usage") or {}
            return result
    if route.fallback:  # after the cache lookup: a cache answer ran on no bundle
        guard.metrics.fallback.inc()
    if route.engine is not guard.primary:
        await _compile_on(route.engine, requests)
    if mode == Mode.BATCH:
        await guard.admit_batch(route, draining=draining, client_gone=client_gone)
    return result


async def _compile_on(engine: Any, requests: list[GenerationRequest]) -> None:
    """The requests' constraints compiled on the engine they go to, in a worker thread: the primary's were before
    routing, but the fallback builds its grammar compiler on first use (about a second on a real vocabulary), and
    ``submit`` would do that on the event loop, stalling every stream."""
    wanted = {r.constraint for r in requests if r.constraint is not None}
    if wanted:
        await asyncio.to_thread(lambda: [constraints.checked(engine.grammar, c) for c in wanted])


def store(guard: SloGuard, slo_plan: SloPlan, response: Any) -> Any:
    """Keep a successful reproducible answer for the level-2 cache; returns the response with the header set."""
    if isinstance(response, JSONResponse):
        if slo_plan.key is not None and response.status_code == 200:
            guard.cache.put(slo_plan.key, json.loads(response.body))
        response.headers.update(slo_plan.headers)
    return response


def output_key(output: OutputOptions | None) -> str:
    """How the answer is written from its tokens, every OutputOptions field but the logprob formatter (the model's
    token bytes, the same for every request): tool-call parsing (format, tools, named function, max calls) and
    logprobs (how many alternatives), so a tool-calling or logprobs answer is never served for a plain one."""
    if output is None:
        return ""
    return repr(tuple((f.name, getattr(output, f.name)) for f in fields(output) if f.name != "formatter"))
