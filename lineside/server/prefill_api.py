"""POST /v1/prefill, GET and DELETE /v1/prefill/{session_id}: a prompt sent while it is still being written.

The body is a /v1/chat/completions body (messages, chat-template options, tools) or a /v1/completions body
(one prompt) plus ``session_id``; it is checked, rendered and tokenized exactly as that endpoint would, and
the engine caches the KV of the prompt's stable prefix — the rendering up to the end of the last message's
text (chat) or the prompt (completions), less the trailing tokens a continuation could re-tokenize, never the
generation prompt — in idle capacity (runtime/session_scheduling.py). The answer comes at once: 202 with how
many tokens are cached and pending. The completion that follows names the session (``session_id`` or
X-Session-Id) and starts from its KV when its prompt extends it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from lineside.errors import LinesideError
from lineside.runtime.request import EngineDraining, rank_of
from lineside.runtime.sessions import (
    SESSION_ID,
    SessionInfo,
    SessionLimitError,
    SessionsUnsupported,
    check_session_id,
)
from lineside.server import chat_rendering, prompt_limits, request_mapping, tool_calls
from lineside.server.errors import APIError
from lineside.server.openai_api import _check_model, _offload, _prompt_limit, _vocab_size
from lineside.server.schemas import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest
from lineside.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.lineside


async def _json_body(request: Request) -> Any:
    """The body as JSON, refused as FastAPI refuses a model-typed route's (errors.py words each): this route reads
    the body itself, and ``request.json()``'s own errors (an empty body, malformed or too deeply nested JSON) would
    otherwise be a 500."""
    raw = await request.body()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from e
    except Exception as e:  # noqa: BLE001 - RecursionError, a number past int()'s digit limit: FastAPI's catch-all
        raise HTTPException(400, "There was an error parsing the body") from e


def _parse(raw: Any) -> ChatCompletionRequest | CompletionRequest:
    """A chat body when it has ``messages``, else a completions body (pydantic's errors as the routes give them)."""
    if not isinstance(raw, dict):
        raise APIError(400, "request body must be a JSON object with 'messages' (chat) or 'prompt' (completions) "
                            "and 'session_id'", "invalid_request")
    model = ChatCompletionRequest if "messages" in raw else CompletionRequest
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def _completion_only(body: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 naming a field that asks a prefill for what only the completion does: a prefill answers 202 JSON at
    once, samples nothing and keeps the session anyway, so a stream, several choices or keep_session sent here would
    be silently dropped. The fields that only shape the answer (max_tokens, sampling, stop, logprobs, a format) are
    accepted and ignored, so one body can go to both calls (README)."""
    misled = ("stream" if body.stream else "n" if (body.n or 1) > 1 else "keep_session" if body.keep_session
              else None)
    if misled is None:
        return
    what = {"stream": "a prefill answers at once with JSON (202), never a stream",
            "n": "a prefill samples nothing; several choices are the completion's",
            "keep_session": "a session outlives each prefill anyway; keep_session says whether it outlives the "
                            "completion"}[misled]
    raise APIError(400, f"{misled}: {what}; send {misled} with the completion (/v1/chat/completions or "
                        "/v1/completions naming the session), not with /v1/prefill", "unsupported_parameter",
                   param=misled)


def _engine_sessions(state: ServerState) -> Any:
    engine = state.engine
    if not hasattr(engine, "prefill"):
        raise APIError(400, "this server's engine keeps no prefill sessions; send the whole prompt to the "
                            "completion endpoint", "sessions_unsupported")
    return engine


def _body(info: SessionInfo) -> dict[str, Any]:
    return {"id": info.session_id, "object": "prefill.session", "session_id": info.session_id,
            "cached_tokens": info.cached_tokens, "pending_tokens": info.pending_tokens,
            "prompt_tokens": info.prompt_tokens, "expires_in": round(info.expires_in_s, 3)}


def _session_param(value: str | None) -> str:
    if value is None:
        raise APIError(400, "missing required field 'session_id' (or an X-Session-Id header): name the session "
                            "this prompt belongs to", "missing_field", param="session_id")
    return value


async def _tokens(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> tuple[list[int], int, int]:
    """(the prompt's ids as its completion endpoint makes them, how many of them are stable, how many tools are rendered
    into them: a context 400 names those too)."""
    tok, context = state.engine.tokenizer, state.engine.max_seq_len
    if isinstance(body, ChatCompletionRequest):
        request_mapping.check_chat(body)
        prompt_limits.check_texts(prompt_limits.chat_texts(body), tok, context, param="messages")
        messages = request_mapping.chat_messages(body)
        options = request_mapping.chat_template_options(body)
        tools = tool_calls.parse_tools(body.tools)
        tool_choice = tool_calls.parse_tool_choice(body.tool_choice, tools)
        exclude_none = state.exclude_tools_when_tool_choice_none
        def rendered() -> tuple[chat_rendering.Rendering, list[dict[str, Any]], list[dict[str, Any]] | None]:
            render = chat_rendering.rendering(state, body, tool_calls.offered(tools, tool_choice, exclude_none))
            return render, *tool_calls.template_messages(messages, tools, render.effective, tool_choice,
                                                         exclude_none=exclude_none)

        # a request's own template renders in its checks: off the event loop (bounded, yet up to its deadline)
        ours = chat_rendering.renders_request_template(state, body)
        render, messages, listed = await state.template_renders.run(rendered) if ours else rendered()
        size = sum(len(m["content"] or "") for m in messages)
        renders = state.template_renders if render.limits is not None else None
        tool_count = len(tool_calls.offered(tools, tool_choice, exclude_none) or ())
        with render.blamed():
            ids = await _offload(size, functools.partial(state.tokenizer.encode_chat, messages, tools=listed, **options,
                                                         **render.options(), max_tokens=_prompt_limit(state)),
                                 param="messages", renders=renders, tools=tool_count)
            stable = await _offload(size, functools.partial(state.tokenizer.stable_chat_ids, messages, listed,
                                                            **render.options()), param="messages", renders=renders)
        add, bos_tok = body.add_special_tokens is True, state.engine.tokenizer  # BOS on top, as chat encodes it
        ids = request_mapping.with_special_tokens(ids, bos_tok, add)
        stable = request_mapping.with_special_tokens(stable, bos_tok, add)
        return ids, _agreeing(ids, stable), tool_count
    request_mapping.check_completion(body)
    body = _one_prompt(body)
    for text in prompt_limits.prompt_texts(body):
        prompt_limits.check_texts([text], tok, context, param="prompt")
    ids = (await _offload(len(body.prompt) if isinstance(body.prompt, str) else 0,
                          functools.partial(request_mapping.completion_prompts, body, state.tokenizer,
                                            _vocab_size(state), max_tokens=_prompt_limit(state)),
                          param="prompt"))[0]
    if not isinstance(body.prompt, str):
        return ids, len(ids), 0  # token ids do not re-tokenize
    text = request_mapping.clean_text(body.prompt, "prompt")
    stable = await _offload(len(text), functools.partial(state.tokenizer.stable_text_ids, text), param="prompt")
    return ids, _agreeing(ids, stable), 0


def _one_prompt(body: CompletionRequest) -> CompletionRequest:
    """The body with its one prompt bare: a list of one prompt is that prompt, as /v1/completions takes it (LangChain's
    OpenAI LLM always sends ``[text]``), so one body still goes to both calls; an empty list is left for
    completion_prompts to name; two or more prompts are a 400."""
    p = body.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        return body.model_copy(update={"prompt": p[0]})
    if isinstance(p, list) and p and not all(isinstance(t, int) for t in p):
        raise APIError(400, f"prefill takes one prompt (a string or one list of token ids), not a list of {len(p)} "
                       "prompts; send each prompt under its own session_id", "invalid_value", param="prompt")
    return body


def _agreeing(ids: list[int], stable: list[int]) -> int:
    n = 0
    for a, b in zip(ids, stable, strict=False):
        if a != b:
            break
        n += 1
    return n


# The body is one of two request models, told apart by 'messages'; the schema documents the completions form.
_BODY_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["prompt", "session_id"],
    "properties": {"prompt": {"type": "string", "description": "the prompt so far (or 'messages', as in chat)"},
                   "session_id": {"type": "string", "pattern": SESSION_ID.pattern},
                   "model": {"type": "string"},
                   "cache_salt": {"type": "string", "minLength": 1,
                                  "description": "vLLM's: lent only to completions sending the same salt"}}}}}}}


@router.post("/v1/prefill", status_code=202, responses=ERROR_RESPONSES, openapi_extra=_BODY_DOC)
async def prefill(request: Request) -> Any:
    """Cache the KV of a prompt still being written under ``session_id``; answers at once."""
    state = _state(request)
    try:
        body = _parse(await _json_body(request))
        _completion_only(body)
        if _check_model(state, body.model) is not None:  # a session's KV is the base model's (scheduler.py)
            raise APIError(400, f"prefill sessions run on the base model, not on the LoRA adapter {body.model!r}; "
                                "send the base model's name (or none)", "unsupported_value", param="model")
        # body session_id or X-Session-Id, as on the completion routes (both: they must agree)
        session = _session_param(request_mapping.session_id(body, request.headers))
        priority, mode = request_mapping.priority(request.headers)
        engine = _engine_sessions(state)
        ids, stable, tools = await _tokens(state, body)
        request_mapping.token_budget(len(ids), None, 1, context=engine.max_seq_len, param="max_tokens",
                                     prompt_param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                                     tools=tools)
        info = engine.prefill(session, ids, stable, rank=rank_of(priority, mode), cache_salt=body.cache_salt)
    except SessionLimitError as e:
        state.metrics.reject("too_many_sessions")
        raise APIError(429, str(e), "too_many_sessions",
                       headers={"Retry-After": str(max(1, int(e.retry_after_s + 0.999)))}) from None
    except EngineDraining as e:
        state.metrics.reject("draining")
        raise APIError(409, str(e), "draining") from None
    except SessionsUnsupported as e:
        state.metrics.reject("invalid")
        raise APIError(400, str(e), "sessions_unsupported") from None
    except APIError:
        state.metrics.reject("invalid")
        raise
    except LinesideError as e:
        state.metrics.reject("invalid")
        raise APIError(400, str(e), "invalid_request") from None
    return JSONResponse(_body(info), status_code=202)


def _known(request: Request, session_id: str) -> tuple[Any, str]:
    state = _state(request)
    if not state.engine_ready:
        raise APIError(503, "model is still loading; retry when GET /health/ready answers 200", "not_ready")
    engine = _engine_sessions(state)
    try:
        return engine, check_session_id(session_id)
    except LinesideError as e:
        raise APIError(400, str(e), "invalid_session_id", param="session_id") from None


def _not_found(session_id: str) -> APIError:
    return APIError(404, f"no prefill session {session_id!r} here (never made, expired, ended with its completion "
                         "or released for memory); POST /v1/prefill makes one", "session_not_found",
                    param="session_id")


@router.get("/v1/prefill/{session_id}", responses=ERROR_RESPONSES)
async def get_session(session_id: str, request: Request) -> Any:
    """A session's cached and pending tokens and time to expiry."""
    engine, sid = _known(request, session_id)
    try:
        info = engine.session(sid)
    except SessionsUnsupported as e:
        raise APIError(400, str(e), "sessions_unsupported") from None
    if info is None:
        raise _not_found(sid)
    return _body(info)


@router.delete("/v1/prefill/{session_id}", responses=ERROR_RESPONSES)
async def delete_session(session_id: str, request: Request) -> Any:
    """End a session now (its prompt was abandoned): its blocks are free for others at once."""
    engine, sid = _known(request, session_id)
    try:
        gone = engine.release_session(sid)
    except SessionsUnsupported as e:
        raise APIError(400, str(e), "sessions_unsupported") from None
    if not gone:
        raise _not_found(sid)
    return {"id": sid, "object": "prefill.session.deleted", "deleted": True}
