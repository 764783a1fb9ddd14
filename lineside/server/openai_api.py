"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models: OpenAI's API over the engine.

A request becomes one engine request per prompt; their events are merged into one response
(SSE or JSON). A client that goes away cancels its engine requests so their slots and KV are freed.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from typing import Any

from fastapi import APIRouter, Request

from lineside.errors import LinesideError
from lineside.runtime.request import EngineDraining, QueueFullError
from lineside.server import prompt_limits, request_mapping, responses, sse
from lineside.server.errors import APIError
from lineside.server.metrics import RequestRecord
from lineside.server.schemas import (
    ERROR_RESPONSES,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from lineside.server.state import ServerState

router = APIRouter()
_serial = itertools.count()  # engine ids stay unique even when clients reuse an X-Request-Id
_INLINE_CHARS = 8192
_STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"}}


def _state(request: Request) -> ServerState:
    return request.app.state.lineside


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    s = _state(request)
    return {"object": "list", "data": [_card(s, name) for name in s.listed_names]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: ERROR_RESPONSES[400]})
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    s = _state(request)
    if not model_id:
        raise APIError(404, f"no model named; GET /v1/models lists them, GET /v1/models/{s.model_name} shows one",
                       "model_not_found", "model", type="invalid_request_error")
    _check_model(s, model_id)
    return _card(s, model_id)


def _check_model(s: ServerState, model: str | None) -> None:
    """404 model_not_found (as OpenAI, vLLM and Ollama answer) for a model this server does not serve;
    an absent or empty model means the one served."""
    if model and model not in s.served_names:
        served = " or ".join(repr(n) for n in s.served_names)
        raise APIError(404, f"model {model!r} is not served here; this server serves {served} "
                            "(send that name, or leave 'model' out)", "model_not_found", "model",
                       type="invalid_request_error")


def _card(s: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": s.started_at, "owned_by": "lineside",
            "max_model_len": getattr(s.engine, "max_seq_len", None)}


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={**ERROR_RESPONSES, **_STREAM_DOC})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    s = _state(request)
    try:
        _check_model(s, body.model)
        request_mapping.check_chat(body)
        prompt_limits.check_texts(prompt_limits.chat_texts(body), s.engine.tokenizer, s.engine.max_seq_len, "messages")
        messages = request_mapping.chat_messages(body)
        options = request_mapping.chat_template_options(body)
        size = sum(len(m["content"]) for m in messages)
        ids = await _offload(size, functools.partial(s.tokenizer.encode_chat, messages, **options))
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        budgets = [request_mapping.token_budget(len(ids), requested, None, s.engine.max_seq_len, param, "messages")]
    except (APIError, LinesideError):
        s.metrics.reject("invalid")
        raise
    return await _serve(request, s, body, [ids], budgets, chat=True)


@router.post("/v1/completions", response_model=Completion, responses={**ERROR_RESPONSES, **_STREAM_DOC})
async def completions(body: CompletionRequest, request: Request) -> Any:
    s = _state(request)
    try:
        _check_model(s, body.model)
        request_mapping.check_completion(body)
        for text in prompt_limits.prompt_texts(body):
            prompt_limits.check_texts([text], s.engine.tokenizer, s.engine.max_seq_len, "prompt")
        size = len(body.prompt) if isinstance(body.prompt, str) else sum(
            len(p) for p in body.prompt if isinstance(p, str))
        prompts = await _offload(size, request_mapping.completion_prompts, body, s.tokenizer, _vocab(s))
        budgets = [request_mapping.token_budget(len(p), body.max_tokens, 16, s.engine.max_seq_len, "max_tokens", "prompt")
                   for p in prompts]
    except (APIError, LinesideError):
        s.metrics.reject("invalid")
        raise
    return await _serve(request, s, body, prompts, budgets, chat=False)


async def _offload(size: int, fn: Any, *args: Any) -> Any:
    """Tokenize long texts in a worker thread so other streams keep flowing; short ones inline (faster)."""
    if size > _INLINE_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _vocab(s: ServerState) -> int:
    v = getattr(s.engine, "vocab_size", None)
    return int(v) if v else int(s.engine.tokenizer.vocab_size)


async def _serve(request: Request, s: ServerState, body: ChatCompletionRequest | CompletionRequest,
                 prompts: list[list[int]], budgets: list[int], chat: bool) -> Any:
    rid: str = request.scope["state"]["request_id"]
    arrival: float = request.scope["state"].get("t0", time.perf_counter())
    try:
        pr, mode = request_mapping.priority(request.headers)
        stops = request_mapping.stop_list(body)
        n = request_mapping.choices_per_prompt(body, len(prompts))
    except APIError:
        s.metrics.reject("invalid")
        raise
    handles, recs = [], []
    endpoint = "chat" if chat else "completions"
    try:
        # choice index = prompt * n + copy, as OpenAI orders them; copies share the prompt's cached prefix
        for k, (ids, budget, copy) in enumerate((ids, b, j) for ids, b in zip(prompts, budgets, strict=True)
                                                for j in range(n)):
            erid = rid if len(prompts) * n == 1 else f"{rid}-{k}"
            handles.append(s.engine.submit(request_mapping.engine_request(ids, budget, body, stops, pr, mode,
                                                                  s.request_timeout, f"{erid}#{next(_serial)}",
                                                                  copy)))
            recs.append(RequestRecord(erid, endpoint, pr, mode, bool(body.stream), arrival,
                                      prompt_tokens=len(ids), extra={"copy": copy} if copy else {}))
    except QueueFullError as e:
        responses.cancel_all(handles)
        s.metrics.reject("queue_full")
        raise APIError(429, f"the server's waiting queue is full ({e}); retry after a moment",
                       "queue_full", headers={"Retry-After": "1"}) from None
    except EngineDraining:
        responses.cancel_all(handles)
        s.metrics.reject("draining")
        raise APIError(503, "server is shutting down and takes no new requests", "draining",
                       headers={"Retry-After": "5"}) from None
    except LinesideError as e:
        responses.cancel_all(handles)
        s.metrics.reject("invalid")
        raise APIError(400, str(e), "invalid_request") from None
    prefix = "chatcmpl-" if chat else "cmpl-"
    resp_id = prefix + rid
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        w = sse.ChunkWriter(chat, resp_id, created, s.model_name, include_usage)
        return responses.GenerationStream(responses.stream_events(s, w, handles, recs), handles, recs, s)
    return await responses.complete(request, s, handles, recs, chat, resp_id, created)
