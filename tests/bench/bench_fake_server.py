"""A tiny fake OpenAI-compatible SSE server with known timings, for the bench's end-to-end tests.

Every choice streams `max_tokens` chunks of one token: the first after `ttft` seconds, then one per
`step` seconds. A prompt containing FAIL gets an OpenAI-shaped 500; SLOW makes every step 1 s; THINK (chat)
streams every token as a reasoning model's thinking (`delta.reasoning_content`, as `serve --reasoning-parser`). With
``api_key`` every route but /health/ready wants 'Authorization: Bearer <api_key>' (an OpenAI-shaped 401), as
`lineside serve --api-key` does. With ``tokens_per_chunk`` k every chunk carries k tokens (speculative decoding's
way); with ``usage=False`` the server ignores stream_options.include_usage (as some servers do). With ``spec``
(drafted, accepted) every request adds that many proposed and kept tokens and one verify step to /metrics'
speculative-decoding counters (lineside's names). A chat request with "tools" answers with one tool call only
(`delta.tool_calls`: the name "lookup" as the first token, then one argument token per chunk; no content).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def make_app(ttft: float = 0.03, step: float = 0.005, model: str = "fake-model", api_key: str = "",
             ready_body: dict | None = None, tokens_per_chunk: int = 1, usage: bool = True,
             spec: tuple[int, int] | None = None) -> FastAPI:
    app = FastAPI()
    app.state.inflight = 0
    app.state.max_inflight = 0
    app.state.requests = 0
    app.state.spec = [0, 0, 0]  # drafted, accepted, verify steps: (spec's two) and 1 step more per request

    if spec is not None:
        @app.get("/metrics")
        async def metrics():
            drafted, accepted, steps = app.state.spec
            return PlainTextResponse(f"lineside_spec_decode_num_draft_tokens_total {drafted}\n"
                                     f"lineside_spec_decode_num_accepted_tokens_total {accepted}\n"
                                     f"lineside_spec_decode_acceptance_rate_count {steps}\n")

    if api_key:
        @app.middleware("http")
        async def auth(request: Request, call_next):
            if request.url.path != "/health/ready" and request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": {"message": "wrong API key", "type": "authentication_error",
                                               "code": "invalid_api_key"}}, status_code=401)
            return await call_next(request)

    @app.get("/health/ready")
    async def ready():
        if ready_body is not None:
            return ready_body
        # what lineside's server says of its own start and of the backend it chose
        return {"status": "ready", "ready_after_s": 1.25, "backend": "tensorrt",
                "backend_reason": "engine e.plan matches this GPU"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    def _sse(obj) -> str:
        return "data: " + json.dumps(obj) + "\n\n"

    async def _stream(prompts: list[str], max_tokens: int, chat: bool, include_usage: bool, tools: bool = False):
        app.state.inflight += 1
        app.state.max_inflight = max(app.state.max_inflight, app.state.inflight)
        try:
            slow = any("SLOW" in p for p in prompts)
            think = chat and any("THINK" in p for p in prompts)
            created = int(time.time())
            if chat:  # a role-only first delta carries no token and must not be counted
                yield _sse({"object": "chat.completion.chunk", "created": created,
                            "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(1.0 if slow else ttft)
            for s in range(0, max_tokens, tokens_per_chunk):
                if s:
                    await asyncio.sleep(1.0 if slow else step)
                text = "".join(f" t{j}" for j in range(s, min(s + tokens_per_chunk, max_tokens)))
                for i in range(len(prompts)):
                    delta = {"reasoning_content": text, "reasoning": text} if think else {"content": text}
                    if tools:  # a call's name is its first token, then its arguments, as vLLM's tool parsers stream
                        call = {"index": 0, "id": "call_0", "type": "function",
                                "function": {"name": "lookup", "arguments": ""}} if not s else \
                            {"index": 0, "function": {"arguments": text}}
                        delta = {"tool_calls": [call]}
                    choice = {"index": i, "delta": delta} if chat else {"index": i, "text": text}
                    yield _sse({"object": "text_completion", "created": created, "choices": [choice]})
            if tools:
                yield _sse({"object": "chat.completion.chunk", "created": created,
                            "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
            if include_usage and usage:
                yield _sse({"choices": [], "usage": {"prompt_tokens": sum(len(p.split()) for p in prompts),
                                                    "completion_tokens": max_tokens * len(prompts)}})
            yield "data: [DONE]\n\n"
        finally:
            app.state.inflight -= 1

    async def _handle(request: Request, chat: bool):
        app.state.requests += 1
        if spec is not None:  # counted on arrival: done before the answer, so a read after the last answer sees it
            app.state.spec = [app.state.spec[0] + spec[0], app.state.spec[1] + spec[1], app.state.spec[2] + 1]
        body = await request.json()
        if chat:
            prompts = [" ".join(m["content"] for m in body["messages"])]
        else:
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        if any("FAIL" in p for p in prompts):
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error", "code": 500}},
                                status_code=500)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        tools = chat and bool(body.get("tools"))
        return StreamingResponse(_stream(prompts, int(body.get("max_tokens", 16)), chat, usage, tools),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    return app
