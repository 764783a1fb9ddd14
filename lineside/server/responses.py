"""Turning engine events into responses: SSE streams and JSON bodies, with the cleanup that frees a
client's engine requests however the response ends (finished, failed, or the client went away)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lineside.runtime.request import FinishReason, RequestHandle, TokenEvent
from lineside.server import sse
from lineside.server.errors import APIError
from lineside.server.metrics import RequestRecord, ServerMetrics, combined
from lineside.server.outputs import ChoiceOutput, Echo, OutputOptions
from lineside.server.state import ServerState


@dataclass
class Choice:
    """One choice of a response: the engine request that samples it and the metrics record it fills.

    ``index`` is OpenAI's order, prompt * n + copy; ``copy`` j > 0 is another sample of the same prompt,
    so its prompt tokens are not counted again in the usage.
    """

    index: int
    handle: RequestHandle
    record: RequestRecord
    _: KW_ONLY
    copy: int = 0
    text_parts: list[str] = field(default_factory=list)  # a non-streamed response's text, as it came
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    options: OutputOptions | None = None  # tool calls / logprobs this response reports
    echo: Echo | None = None  # completions' echo: the prompt in front of the text
    output: ChoiceOutput = field(init=False)
    counted: bool = field(default=False, init=False)  # its request is in the metrics (observe_finished)

    def __post_init__(self) -> None:
        self.output = ChoiceOutput(self.options or OutputOptions(chat=True), self.echo)

    def note(self, event: TokenEvent, now: float) -> None:
        """Fold one engine event into the metrics record (first token, gaps between tokens, token counts, outcome at
        the end)."""
        record = self.record
        if event.completion_tokens > record.completion_tokens:
            if record.last_token is not None:
                record.itl.append(now - record.last_token)
            record.last_token = now
        if record.first_token is None and event.completion_tokens > 0:
            record.first_token = now
        record.completion_tokens = event.completion_tokens
        record.prompt_tokens = event.prompt_tokens or record.prompt_tokens
        if event.finish_reason is not None:
            # a request its own grammar ended (past the grammar engine's limits once generating) is answered as the
            # client's error (failure()): counted as the 400s are, not as the engine's failure
            record.outcome = "invalid" if event.client_error else event.finish_reason
            record.end = now
            record.queue_s = getattr(self.handle.metrics, "queue_time", None)
            record.extra["engine_ttft_s"] = getattr(self.handle.metrics, "ttft", None)  # submit → token, in the engine

    def abandon(self) -> None:
        """Cancel the engine request if it is still running and mark it cancelled (the client went away)."""
        if self.record.end is None:
            self.handle.cancel()
            self.record.outcome = "cancelled"
            self.record.end = time.perf_counter()
            self.record.queue_s = getattr(self.handle.metrics, "queue_time", None)


def observe_finished(metrics: ServerMetrics, choices: list[Choice]) -> None:
    """Count the request in the metrics and the latency log once its last choice has ended, as one request
    (metrics.combined): the client gets one response however many choices it holds."""
    if any(c.record.end is None for c in choices) or any(c.counted for c in choices):
        return
    for c in choices:
        c.counted = True
    metrics.observe(combined([c.record for c in choices], prompt_tokens=prompt_usage(choices)))


def prompt_usage(choices: list[Choice]) -> int:
    """usage.prompt_tokens: each prompt once, however many choices (n) were sampled from it (as OpenAI)."""
    return sum(c.record.prompt_tokens for c in choices if not c.copy)


def cached_usage(choices: list[Choice]) -> int:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's, llama.cpp's): the prompt tokens whose KV the prefix cache
    (or a prefill session) gave, counted as prompt_tokens is: once per prompt, from its first choice."""
    return sum(c.handle.metrics.prefix_reused_tokens for c in choices if not c.copy)


def completion_usage(choices: list[Choice]) -> int:
    return sum(c.record.completion_tokens for c in choices)


def reasoning_usage(choices: list[Choice]) -> int | None:
    """usage.completion_tokens_details.reasoning_tokens (OpenAI's): the tokens each choice wrote inside its reasoning,
    ``</think>`` included, whether or not the response carries the reasoning; None without a reasoning parser."""
    splits = [c.output.reasoning for c in choices]
    if any(s is None for s in splits):
        return None
    return sum(s.reasoning_tokens for s in splits if s is not None)


def cancel_all(choices: list[Choice]) -> None:
    for choice in choices:
        choice.handle.cancel()


async def _merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, TokenEvent]]:
    """(choice, event) from every choice's handle as they come; a single handle is read directly."""
    if len(choices) == 1:
        async for event in choices[0].handle:
            yield choices[0], event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for event in choice.handle:
                queue.put_nowait((choice, event))
        except Exception as e:  # noqa: BLE001 - surfaced to the consumer
            queue.put_nowait((choice, e))

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    try:
        left = len(choices)
        while left:
            choice, event = await queue.get()
            if isinstance(event, Exception):
                raise event
            if event.finish_reason is not None:
                left -= 1
            yield choice, event
    finally:
        for task in tasks:
            task.cancel()


_FAILURES = {
    FinishReason.TIMEOUT: (408, "timeout_error", "request_timeout",
                "generation exceeded the server's request timeout ({t}s) after {n} tokens; lower max_tokens "
                "or ask the operator to raise --request-timeout"),
    FinishReason.CANCELLED: (503, "service_unavailable", "cancelled",
                  "generation was cancelled (the server is shutting down); retry"),
    FinishReason.ERROR: (500, "server_error", "engine_error", "generation failed in the engine: {err}"),
}


def failure(state: ServerState, event: TokenEvent) -> APIError:
    """The error a request that ended without stop or length answers with (streamed: its error event)."""
    if event.client_error and event.error:  # the request's grammar past the engine's limits or at a dead end
        return APIError(400, event.error, event.error_code or "grammar_too_large", param=event.error_param,
                        type="invalid_request_error", headers={"x-should-retry": "false"})
    if event.engine_failed and event.error:  # not this request's failure: the engine's; retry elsewhere
        return APIError(503, f"{event.error}; retry on another instance", "engine_failed", type="service_unavailable")
    status, error_type, code, message = _FAILURES[event.finish_reason]
    # openai clients retry 408 by default; the same request would time out again
    headers = {"x-should-retry": "false"} if event.finish_reason == FinishReason.TIMEOUT else None
    return APIError(status, message.format(t=state.request_timeout, n=event.completion_tokens,
                                           err=getattr(event, "error", None) or "unknown error"), code,
                    type=error_type, headers=headers)


async def stream_events(state: ServerState, writer: sse.ChunkWriter, choices: list[Choice]) -> AsyncIterator[str]:
    """The SSE body: each choice's chunks as its tokens come, then the usage (if asked) and [DONE]."""
    def counted(choice: Choice, chunk: str) -> str:  # continuous_usage_stats: the choice's usage so far
        if not writer.continuous_usage:
            return chunk
        return writer.with_usage(chunk, choice.record.prompt_tokens, choice.record.completion_tokens,
                                 reasoning_usage([choice]))

    if writer.chat:
        for choice in choices:
            yield counted(choice, writer.role(choice.index))
    async for choice, event in _merged(choices):
        choice.note(event, time.perf_counter())
        for chunk in choice.output.chunks(writer, choice.index, event):
            yield counted(choice, chunk)
        if event.finish_reason is None:
            continue
        observe_finished(state.metrics, choices)
        if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            yield counted(choice, writer.finish(choice.index, choice.output.finish_reason(event.finish_reason),
                                                event.stop_reason))
        else:
            error = failure(state, event)
            cancel_all(choices)
            yield sse.error_event(error.message, error.type, error.code, error.param)
            yield sse.DONE
            return
    if writer.include_usage:
        yield writer.usage(prompt_usage(choices), completion_usage(choices), cached_usage(choices),
                           reasoning_usage(choices))
    yield sse.DONE


class GenerationStream(StreamingResponse):
    """A StreamingResponse that cancels its engine requests however the stream ends (client gone included)."""

    def __init__(self, content: AsyncIterator[str], choices: list[Choice], state: ServerState):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._choices, self._state = choices, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _abandon(self._state, self._choices)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except (RuntimeError, asyncio.CancelledError):
                    pass


def _abandon(state: ServerState, choices: list[Choice]) -> None:
    for choice in choices:
        choice.abandon()
    observe_finished(state.metrics, choices)


async def client_left(request: Request) -> None:
    """Return once the client disconnects (its body read: what receive() answers then is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_gone() -> JSONResponse:
    """The answer to a request whose client went away: nobody reads it (499, nginx's "client closed request")."""
    return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled",
                                   "code": "client_disconnected", "param": None}}, status_code=499)


async def _watch_disconnect(request: Request, choices: list[Choice]) -> None:
    """Cancel the generation when the client of a non-streaming request disconnects."""
    await client_left(request)
    cancel_all(choices)


async def complete(request: Request, state: ServerState, choices: list[Choice], *, chat: bool, response_id: str,
                   created: int, model: str | None = None) -> Any:
    """The JSON body: every choice's whole text once all have finished (or the first failure as an error)."""
    gone = await collect(request, state, choices)
    if gone is not None:
        return gone
    usage = {"prompt_tokens": prompt_usage(choices), "completion_tokens": completion_usage(choices)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    usage["prompt_tokens_details"] = {"cached_tokens": cached_usage(choices)}
    if chat and (reasoning := reasoning_usage(choices)) is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    body_choices = []
    for c in choices:
        if chat:
            message, logprobs = c.output.message("".join(c.text_parts))  # first: it parses the tool calls
            reason = c.output.finish_reason(c.finish_reason or FinishReason.STOP)
            body_choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason,
                                 "stop_reason": c.stop_reason})
        else:
            reason = c.output.finish_reason(c.finish_reason or FinishReason.STOP)
            body_choices.append({"index": c.index, "text": c.output.text(c.text_parts),
                                 "logprobs": c.output.text_logprobs(), "finish_reason": reason,
                                 "stop_reason": c.stop_reason})
            if (block := c.output.prompt_block()) is not None:  # vLLM's: each choice its prompt's
                body_choices[-1]["prompt_logprobs"] = block
    obj = "chat.completion" if chat else "text_completion"
    body = {"id": response_id, "object": obj, "created": created, "model": model or state.model_name,
            "system_fingerprint": None, "choices": body_choices, "usage": usage}
    if chat and choices and (block := choices[0].output.prompt_block()) is not None:
        body["prompt_logprobs"] = block  # vLLM's: the one prompt's, beside the choices
    return JSONResponse(body)


async def collect(request: Request, state: ServerState, choices: list[Choice]) -> JSONResponse | None:
    """Read every choice to its end into ``text_parts`` / ``finish_reason``; raises the first failure as its
    APIError; returns the 499 answer when the client went away (nobody reads it), else None."""
    watcher = asyncio.create_task(_watch_disconnect(request, choices))
    try:
        async for choice, event in _merged(choices):
            choice.note(event, time.perf_counter())
            choice.output.collect(event)
            if event.text:
                choice.text_parts.append(event.text)
            if event.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = event.finish_reason, event.stop_reason
                observe_finished(state.metrics, choices)
                if event.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                    cancel_all(choices)
                    if watcher.done():  # the client left: nobody reads this answer
                        return client_gone()
                    raise failure(state, event)
    finally:
        watcher.cancel()
        _abandon(state, choices)
    return None
