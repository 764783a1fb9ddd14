"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models: OpenAI's API over the engine.

A request becomes one engine request per prompt; their events are merged into one response
(SSE or JSON). A client that goes away cancels its engine requests so their slots and KV are freed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from trtedge.errors import TrtedgeError
from trtedge.runtime.request import EngineDraining, QueueFullError
from trtedge.server import convert, sse
from trtedge.server.errors import APIError
from trtedge.server.metrics import RequestRecord
from trtedge.server.schemas import (
    ERROR_RESPONSES,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from trtedge.server.state import ServerState

router = APIRouter()
_serial = itertools.count()
_INLINE_CHARS = 8192  # engine ids stay unique even when clients reuse an X-Request-Id
_STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"}}


def _state(request: Request) -> ServerState:
    return request.app.state.trtedge


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    s = _state(request)
    return {"object": "list", "data": [_card(s)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: ERROR_RESPONSES[400]})
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    s = _state(request)
    if model_id != s.model_name:
        raise APIError(404, f"model {model_id!r} is not served here; this server serves {s.model_name!r}",
                       "model_not_found", "model")
    return _card(s)


def _card(s: ServerState) -> dict[str, Any]:
    return {"id": s.model_name, "object": "model", "created": s.started_at, "owned_by": "trtedge",
            "max_model_len": getattr(s.engine, "max_seq_len", None)}


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={**ERROR_RESPONSES, **_STREAM_DOC})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    s = _state(request)
    try:
        convert.check_chat(body)
        messages = convert.chat_messages(body)
        size = sum(len(m["content"]) for m in messages)
        ids = await _offload(size, s.engine.tokenizer.encode_chat, messages)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        budgets = [convert.token_budget(len(ids), requested, None, s.engine.max_seq_len, param, "messages")]
    except (APIError, TrtedgeError):
        s.metrics.reject("invalid")
        raise
    return await _serve(request, s, body, [ids], budgets, chat=True)


@router.post("/v1/completions", response_model=Completion, responses={**ERROR_RESPONSES, **_STREAM_DOC})
async def completions(body: CompletionRequest, request: Request) -> Any:
    s = _state(request)
    try:
        convert.check_completion(body)
        size = len(body.prompt) if isinstance(body.prompt, str) else sum(
            len(p) for p in body.prompt if isinstance(p, str))
        prompts = await _offload(size, convert.completion_prompts, body, s.engine.tokenizer, _vocab(s))
        budgets = [convert.token_budget(len(p), body.max_tokens, 16, s.engine.max_seq_len, "max_tokens", "prompt")
                   for p in prompts]
    except (APIError, TrtedgeError):
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
        pr, mode = convert.priority(request.headers)
        stops = convert.stop_list(body)
    except APIError:
        s.metrics.reject("invalid")
        raise
    handles, recs = [], []
    endpoint = "chat" if chat else "completions"
    try:
        for i, (ids, budget) in enumerate(zip(prompts, budgets, strict=True)):
            erid = rid if len(prompts) == 1 else f"{rid}-{i}"
            handles.append(s.engine.submit(convert.engine_request(ids, budget, body, stops, pr, mode,
                                                                  s.request_timeout, f"{erid}#{next(_serial)}")))
            recs.append(RequestRecord(erid, endpoint, pr, mode, bool(body.stream), arrival,
                                      prompt_tokens=len(ids)))
    except QueueFullError as e:
        _cancel_all(handles)
        s.metrics.reject("queue_full")
        raise APIError(429, f"the server's waiting queue is full ({e}); retry after a moment",
                       "queue_full", headers={"Retry-After": "1"}) from None
    except EngineDraining:
        _cancel_all(handles)
        s.metrics.reject("draining")
        raise APIError(503, "server is shutting down and takes no new requests", "draining",
                       headers={"Retry-After": "5"}) from None
    except TrtedgeError as e:
        _cancel_all(handles)
        s.metrics.reject("invalid")
        raise APIError(400, str(e), "invalid_request") from None
    prefix = "chatcmpl-" if chat else "cmpl-"
    resp_id = prefix + rid
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        w = sse.ChunkWriter(chat, resp_id, created, s.model_name, include_usage)
        return GenerationStream(_stream(s, w, handles, recs), handles, recs, s)
    return await _complete(request, s, handles, recs, chat, resp_id, created)


def _cancel_all(handles: list[Any]) -> None:
    for h in handles:
        h.cancel()


async def _merged(handles: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, event) from every handle as they come; a single handle is read directly."""
    if len(handles) == 1:
        async for ev in handles[0]:
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: Any) -> None:
        try:
            async for ev in h:
                q.put_nowait((i, ev))
        except Exception as e:  # noqa: BLE001 - surfaced to the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, ev = await q.get()
            if isinstance(ev, Exception):
                raise ev
            if ev.finish_reason is not None:
                left -= 1
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()


def _note(rec: RequestRecord, handle: Any, ev: Any, now: float) -> None:
    if rec.first_token is None and ev.completion_tokens > 0:
        rec.first_token = now
    rec.completion_tokens = ev.completion_tokens
    rec.prompt_tokens = ev.prompt_tokens or rec.prompt_tokens
    if ev.finish_reason is not None:
        rec.outcome = ev.finish_reason
        rec.end = now
        rec.queue_s = getattr(handle.metrics, "queue_time", None)
        rec.extra["engine_ttft_s"] = getattr(handle.metrics, "ttft", None)  # submit → token, inside the engine


_FAILURES = {
    "timeout": (408, "timeout_error", "request_timeout",
                "generation exceeded the server's request timeout ({t}s) after {n} tokens; lower max_tokens "
                "or ask the operator to raise --request-timeout"),
    "cancelled": (503, "service_unavailable", "cancelled",
                  "generation was cancelled (the server is shutting down); retry"),
    "error": (500, "server_error", "engine_error", "generation failed in the engine: {err}"),
}


def _failure(s: ServerState, ev: Any) -> APIError:
    status, typ, code, msg = _FAILURES[ev.finish_reason]
    # openai clients retry 408 by default; the same request would time out again
    headers = {"x-should-retry": "false"} if ev.finish_reason == "timeout" else None
    return APIError(status, msg.format(t=s.request_timeout, n=ev.completion_tokens,
                                       err=getattr(ev, "error", None) or "unknown error"), code, type=typ,
                    headers=headers)


async def _stream(s: ServerState, w: sse.ChunkWriter, handles: list[Any], recs: list[RequestRecord]
                  ) -> AsyncIterator[str]:
    if w.chat:
        for i in range(len(handles)):
            yield w.role(i)
    async for i, ev in _merged(handles):
        now = time.perf_counter()
        rec = recs[i]
        _note(rec, handles[i], ev, now)
        if ev.text:
            yield w.text(i, ev.text)
        if ev.finish_reason is None:
            continue
        s.metrics.observe(rec)
        if ev.finish_reason in ("stop", "length"):
            yield w.finish(i, ev.finish_reason)
        else:
            e = _failure(s, ev)
            _cancel_all(handles)
            yield sse.error_event(e.message, e.type, e.code)
            yield sse.DONE
            return
    if w.include_usage:
        yield w.usage(sum(r.prompt_tokens for r in recs), sum(r.completion_tokens for r in recs))
    yield sse.DONE


class GenerationStream(StreamingResponse):
    """A StreamingResponse that cancels its engine requests however the stream ends (client gone included)."""

    def __init__(self, content: AsyncIterator[str], handles: list[Any], recs: list[RequestRecord],
                 state: ServerState):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._handles, self._recs, self._s = handles, recs, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _abandon(self._s, self._handles, self._recs)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except (RuntimeError, asyncio.CancelledError):
                    pass


def _abandon(s: ServerState, handles: list[Any], recs: list[RequestRecord]) -> None:
    """Cancel what is still running and count it as cancelled (the client went away)."""
    for h, rec in zip(handles, recs, strict=True):
        if rec.end is None:
            h.cancel()
            rec.outcome = "cancelled"
            rec.end = time.perf_counter()
            rec.queue_s = getattr(h.metrics, "queue_time", None)
            s.metrics.observe(rec)


async def _watch_disconnect(request: Request, handles: list[Any]) -> None:
    """Cancel the generation when the client of a non-streaming request disconnects."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            _cancel_all(handles)
            return


async def _complete(request: Request, s: ServerState, handles: list[Any], recs: list[RequestRecord], chat: bool,
                    resp_id: str, created: int) -> Any:
    texts = [[] for _ in handles]
    finals: list[Any] = [None] * len(handles)
    watcher = asyncio.create_task(_watch_disconnect(request, handles))
    try:
        async for i, ev in _merged(handles):
            _note(recs[i], handles[i], ev, time.perf_counter())
            if ev.text:
                texts[i].append(ev.text)
            if ev.finish_reason is not None:
                finals[i] = ev
                s.metrics.observe(recs[i])
                if ev.finish_reason not in ("stop", "length"):
                    _cancel_all(handles)
                    if watcher.done():  # the client left: nobody reads this answer
                        return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled",
                                                       "code": "client_disconnected", "param": None}},
                                            status_code=499)
                    raise _failure(s, ev)
    finally:
        watcher.cancel()
        _abandon(s, handles, recs)
    usage = {"prompt_tokens": sum(r.prompt_tokens for r in recs),
             "completion_tokens": sum(r.completion_tokens for r in recs)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(t), "refusal": None},
                    "logprobs": None, "finish_reason": f.finish_reason} for i, (t, f) in enumerate(zip(texts, finals, strict=True))]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": "".join(t), "logprobs": None, "finish_reason": f.finish_reason}
                   for i, (t, f) in enumerate(zip(texts, finals, strict=True))]
        obj = "text_completion"
    return JSONResponse({"id": resp_id, "object": obj, "created": created, "model": s.model_name,
                         "system_fingerprint": None, "choices": choices, "usage": usage})
