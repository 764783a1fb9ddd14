"""Turning engine events into responses: SSE streams and JSON bodies, with the cleanup that frees a
client's engine requests however the response ends (finished, failed, or the client went away)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lineside.runtime.request import FinishReason
from lineside.server import sse
from lineside.server.errors import APIError
from lineside.server.metrics import RequestRecord
from lineside.server.state import ServerState


def prompt_usage(recs: list[RequestRecord]) -> int:
    """usage.prompt_tokens: each prompt once, however many choices (n) were sampled from it (as OpenAI)."""
    return sum(r.prompt_tokens for r in recs if not r.extra.get("copy"))


def cancel_all(handles: list[Any]) -> None:
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
    FinishReason.TIMEOUT: (408, "timeout_error", "request_timeout",
                "generation exceeded the server's request timeout ({t}s) after {n} tokens; lower max_tokens "
                "or ask the operator to raise --request-timeout"),
    FinishReason.CANCELLED: (503, "service_unavailable", "cancelled",
                  "generation was cancelled (the server is shutting down); retry"),
    FinishReason.ERROR: (500, "server_error", "engine_error", "generation failed in the engine: {err}"),
}


def _failure(s: ServerState, ev: Any) -> APIError:
    status, typ, code, msg = _FAILURES[ev.finish_reason]
    # openai clients retry 408 by default; the same request would time out again
    headers = {"x-should-retry": "false"} if ev.finish_reason == FinishReason.TIMEOUT else None
    return APIError(status, msg.format(t=s.request_timeout, n=ev.completion_tokens,
                                       err=getattr(ev, "error", None) or "unknown error"), code, type=typ,
                    headers=headers)


async def stream_events(s: ServerState, w: sse.ChunkWriter, handles: list[Any], recs: list[RequestRecord]
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
        if ev.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            yield w.finish(i, ev.finish_reason)
        else:
            e = _failure(s, ev)
            cancel_all(handles)
            yield sse.error_event(e.message, e.type, e.code)
            yield sse.DONE
            return
    if w.include_usage:
        yield w.usage(prompt_usage(recs), sum(r.completion_tokens for r in recs))
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
            cancel_all(handles)
            return


async def complete(request: Request, s: ServerState, handles: list[Any], recs: list[RequestRecord], chat: bool,
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
                if ev.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                    cancel_all(handles)
                    if watcher.done():  # the client left: nobody reads this answer
                        return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled",
                                                       "code": "client_disconnected", "param": None}},
                                            status_code=499)
                    raise _failure(s, ev)
    finally:
        watcher.cancel()
        _abandon(s, handles, recs)
    usage = {"prompt_tokens": prompt_usage(recs),
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
