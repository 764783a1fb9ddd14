"""The SLO guard's part of serving one request (openai_api._serve calls it): route, level-2 cache lookup,
level-1 batch gate, the degraded header, and storing reproducible answers for later repeats."""

from __future__ import annotations

import json
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from lineside.runtime.request import Mode, Priority
from lineside.server import request_mapping
from lineside.server.slo.cache import cache_key, reproducible
from lineside.server.slo.controller import Level
from lineside.server.slo.guard import Route, SloGuard

DEGRADED_HEADER = "X-Lineside-Degraded"


@dataclass
class SloPlan:
    route: Route
    key: Hashable | None  # set when the answer is reproducible and not streamed: it may be cached
    headers: dict[str, str] = field(default_factory=dict)
    cached: JSONResponse | None = None

    def note(self, record: Any) -> None:
        """The latency log's per-request fields: the level and the bundle that answered."""
        record.extra["slo_level"] = int(self.route.level)
        record.extra["bundle"] = self.route.model


async def plan(guard: SloGuard, body: Any, *, prompts: list[list[int]], budgets: list[int], chat: bool,
               priority: Priority, mode: Mode, stops: list[str], n: int, response_id: str,
               draining: Any) -> SloPlan:
    """Route the request; at level 2 answer an exact repeat from the cache (its own id and time, the cached
    answer's ``model``: the bundle that made it); at level 1 hold batch work for the primary at the gate."""
    tokens = max(len(ids) + budget for ids, budget in zip(prompts, budgets, strict=True))
    top = max((max(ids) for ids in prompts if ids), default=-1)
    route = guard.route(mode=mode, priority=priority, tokens=tokens, top_token=top)
    headers = {DEGRADED_HEADER: str(int(route.level))} if route.level > Level.NORMAL else {}
    key = None
    sampling = request_mapping.sampling_params(body)
    if not body.stream and reproducible(sampling):
        key = cache_key(model=body.model or "", endpoint="chat" if chat else "completions", prompts=prompts,
                        sampling=sampling, budgets=budgets, stops=stops, n=n, output=_output_fields(body))
    result = SloPlan(route, key, headers)
    if key is not None and route.level >= Level.FALLBACK:
        hit = guard.cached(key)
        if hit is not None:
            answer = {**hit, "id": response_id, "created": int(time.time())}
            result.cached = JSONResponse(answer, headers={**headers, "X-Lineside-Cache": "hit"})
            return result
    if mode == Mode.BATCH:
        await guard.admit_batch(route, draining=draining)
    return result


def store(guard: SloGuard, slo_plan: SloPlan, response: Any) -> Any:
    """Keep a successful reproducible answer for the level-2 cache; returns the response with the header set."""
    if isinstance(response, JSONResponse):
        if slo_plan.key is not None and response.status_code == 200:
            guard.cache.put(slo_plan.key, json.loads(response.body))
        response.headers.update(slo_plan.headers)
    return response


_OUTPUT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs",
                  "ignore_eos")


def _output_fields(body: Any) -> str:
    """The request fields besides prompt and sampling that change the answer: a constrained, tool-calling or
    logprobs answer is never served for a plain one (or the other way round)."""
    return json.dumps({f: getattr(body, f, None) for f in _OUTPUT_FIELDS}, sort_keys=True, default=str)
