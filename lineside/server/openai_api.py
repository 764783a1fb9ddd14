"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models: OpenAI's API over the engine.

One request, from HTTP to sampled token: a route below checks the body and tokenizes it
(``request_mapping``: OpenAI fields → token ids, token budgets, one ``GenerationRequest`` per choice);
``_serve`` hands each to ``engine.submit`` (``runtime/engine.py``), which queues it for the engine's loop;
there the scheduler (``runtime/scheduler.py``) plans each step, the backend runs it and the sampler picks
the next token, which goes back as a ``TokenEvent`` on the request's handle; ``responses`` merges the
choices' events into one JSON body or an SSE stream (chunks written by ``sse``). A client that goes away
cancels its engine requests so their slots and KV are freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from lineside.errors import LinesideError
from lineside.runtime.adapter_slots import UnknownAdapter
from lineside.runtime.bounded_encode import PromptTooLong
from lineside.runtime.engine_health import EngineFailed
from lineside.runtime.request import (
    EngineDraining,
    FinishReason,
    GenerationRequest,
    Mode,
    Priority,
    QueueFullError,
)
from lineside.runtime.structured import Constraint, ConstraintError
from lineside.server import (
    chat_rendering,
    constraints,
    prompt_limits,
    prompt_logprobs,
    reasoning,
    request_mapping,
    response_items,
    responses,
    responses_api,
    responses_tools,
    sse,
    tool_calls,
)
from lineside.server.errors import APIError
from lineside.server.logprobs import LogprobFormatter, chat_top_n, completion_top_n
from lineside.server.metrics import RequestRecord
from lineside.server.outputs import Echo, OutputOptions
from lineside.server.response_store import StoredResponse
from lineside.server.responses import Choice
from lineside.server.schemas import (
    ERROR_RESPONSES,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from lineside.server.slo import routing as slo_routing
from lineside.server.slo.guard import ClientGone
from lineside.server.state import ServerState
from lineside.server.template_renders import TemplateRenders
from lineside.server.tokenize_pool import chat_work_size
from lineside.server.unicode_check import check_unicode

router = APIRouter()
_serial = itertools.count()  # engine ids stay unique even when clients reuse an X-Request-Id
_INLINE_CHARS = 8192
_STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"}}


def _state(request: Request) -> ServerState:
    return request.app.state.lineside


# ---- the two generation routes: body → token ids and budgets -------------------------------------------
@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={**ERROR_RESPONSES, **_STREAM_DOC})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = _state(request)
    try:
        adapter = _check_model(state, body.model)
        request_mapping.check_chat(body)
        prompt_limits.check_texts(prompt_limits.chat_texts(body), state.engine.tokenizer, state.engine.max_seq_len,
                                  param="messages")
        prompt = await chat_prompt_off_loop(state, body)
        tools, tool_choice, template = prompt.tools, prompt.tool_choice, prompt.render.effective
        constraint = constraints.request_constraint(body)
        call_constraint = tool_calls.tool_constraint(tools, tool_choice, parallel=body.parallel_tool_calls is not False)
        if call_constraint is not None and constraint is not None:
            raise request_mapping.bad(f"tool_choice {tool_choice.kind.value!r} constrains the output to tool calls; "
                                      f"it cannot be combined with {constraint.param}", "tool_choice")
        constraint = await _checked(state, call_constraint or constraint)
        top_n = chat_top_n(body.logprobs, body.top_logprobs)
        prompt_n = prompt_logprobs.requested(body.prompt_logprobs)
        calling = bool(tools) and tool_choice.kind != tool_calls.ToolChoiceKind.NONE
        output = OutputOptions(chat=True, top_logprobs=top_n, formatter=await _formatter(state, top_n, prompt_n),
                               prompt_logprobs=prompt_n,
                               call_format=tool_calls.call_format(tool_choice, template, state.tool_call_parser)
                               if calling else None,
                               tools=tuple(tools), named=tool_choice.name,
                               max_calls=1 if body.parallel_tool_calls is False else None,
                               chat_echo=echoed_message(body, prompt.messages))
        ids = await encode_chat_prompt(state, prompt, max_tokens=_prompt_limit(state))
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        budgets = [request_mapping.token_budget(len(ids), requested, state.sampling_defaults.max_tokens,
                                                context=state.engine.max_seq_len, param=param, prompt_param="messages",
                                                tools=prompt.tool_count)]
        thinking = reasoning.for_prompt(state.think_for(template), ids, body.include_reasoning)
        output = dataclasses.replace(output, reasoning=thinking)
    except (APIError, LinesideError):
        state.metrics.reject("invalid")
        raise
    return await _serve(request, state, body, prompts=[ids], budgets=budgets, chat=True, constraint=constraint,
                        output=output, adapter=adapter)


@router.post("/v1/completions", response_model=Completion, responses={**ERROR_RESPONSES, **_STREAM_DOC})
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = _state(request)
    try:
        adapter = _check_model(state, body.model)
        request_mapping.check_completion(body)
        constraint = await _checked(state, constraints.request_constraint(body))
        top_n = completion_top_n(body.logprobs)
        prompt_n = prompt_logprobs.requested(body.prompt_logprobs)
        output = OutputOptions(chat=False, top_logprobs=top_n, formatter=await _formatter(state, top_n, prompt_n),
                               echo=bool(body.echo), prompt_logprobs=prompt_n)
        texts = prompt_limits.prompt_texts(body)
        for i, text in enumerate(texts):
            prompt_limits.check_texts([text], state.engine.tokenizer, state.engine.max_seq_len,
                                      param=_nth_prompt(body, i))
        size = sum(map(len, texts))
        prompts = await _offload(size, functools.partial(request_mapping.completion_prompts, body, state.tokenizer,
                                                         _vocab_size(state), max_tokens=_prompt_limit(state)),
                                 param="prompt")
        budgets = [request_mapping.token_budget(len(ids), body.max_tokens, 16, context=state.engine.max_seq_len,
                                                param="max_tokens", prompt_param=_nth_prompt(body, i))
                   for i, ids in enumerate(prompts)]
        echoes = echoed_prompts(body, prompts, state.engine.tokenizer) if body.echo else None
    except (APIError, LinesideError):
        state.metrics.reject("invalid")
        raise
    return await _serve(request, state, body, prompts=prompts, budgets=budgets, chat=False, constraint=constraint,
                        output=output, adapter=adapter, echoes=echoes)


def echoed_prompts(body: CompletionRequest, prompts: list[list[int]], tokenizer: Any) -> list[Echo]:
    """What echo puts in front of each prompt's choices: a text prompt as sent (as OpenAI and vLLM echo it), one sent
    as token ids decoded (special tokens skipped, as in every text this server writes)."""
    sent = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    texts = [p if isinstance(p, str) else None for p in sent] if len(sent) == len(prompts) else [None] * len(prompts)
    return [Echo(text if text is not None else tokenizer.decode(ids), ids[0])
            for text, ids in zip(texts, prompts, strict=True)]


def echoed_message(body: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    """Chat's echo as vLLM does it: the last message's text when it is the assistant's (a message being continued),
    else nothing; a client continuing a message gets it back whole, not only the added part."""
    if not body.echo or not messages or messages[-1].get("role") != "assistant":
        return ""
    content = messages[-1].get("content")
    return content if isinstance(content, str) else ""


def _nth_prompt(body: CompletionRequest, i: int) -> str:
    """The parameter a context 400 names: ``prompt``, or ``prompt.i`` in a list of several prompts (which one)."""
    several = isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) \
        and len(body.prompt) > 1
    return f"prompt.{i}" if several else "prompt"


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A chat body as its template renders it: what /v1/chat/completions encodes, and /tokenize counts."""

    messages: list[dict[str, Any]]  # as the template gets them (tool calls and results in its form)
    listed: list[dict[str, Any]] | None  # the tools the template lists
    options: dict[str, bool]  # add_generation_prompt / continue_final_message
    render: chat_rendering.Rendering
    tools: list[tool_calls.Tool]
    tool_choice: tool_calls.ToolChoice
    tool_count: int  # the tools rendered into the prompt (listed by the template or described as text): a 400 names them
    add_special: bool = False  # vLLM's add_special_tokens: the tokenizer's BOS on top of the template's text


def chat_prompt(state: ServerState, body: Any) -> ChatPrompt:
    """Messages, template options, template and tools of a chat body (each bad value a 400 naming it); one place,
    so a /tokenize count is the chat request's prompt_tokens."""
    messages = request_mapping.chat_messages(body)
    options = request_mapping.chat_template_options(body)
    tools = tool_calls.parse_tools(body.tools)
    tool_choice = tool_calls.parse_tool_choice(body.tool_choice, tools)
    given = tool_calls.offered(tools, tool_choice, state.exclude_tools_when_tool_choice_none)
    render = chat_rendering.rendering(state, body, given)  # picks "tool_use"
    messages, listed = tool_calls.template_messages(messages, tools, render.effective, tool_choice,
                                                    exclude_none=state.exclude_tools_when_tool_choice_none)
    return ChatPrompt(messages, listed, options, render, tools, tool_choice, len(given or ()),
                      getattr(body, "add_special_tokens", None) is True)


async def chat_prompt_off_loop(state: ServerState, body: Any) -> ChatPrompt:
    """chat_prompt(state, body), in a worker thread when the body carries its own template: its checks render it
    (each render bounded by the server's template limits, yet up to their deadline of work)."""
    if chat_rendering.renders_request_template(state, body):
        return await state.template_renders.run(chat_prompt, state, body)
    return chat_prompt(state, body)


async def encode_chat_prompt(state: ServerState, prompt: ChatPrompt, *, max_tokens: int | None) -> list[int]:
    """The rendered chat's token ids (long ones, and any rendered with a request's own template, off the event
    loop); ``max_tokens``: PromptTooLong past it."""
    size = chat_work_size(prompt.messages)
    with prompt.render.blamed():
        ids = await _offload(size, functools.partial(state.tokenizer.encode_chat, prompt.messages, tools=prompt.listed,
                                                     **prompt.options, **prompt.render.options(),
                                                     max_tokens=max_tokens), param="messages",
                             renders=state.template_renders if prompt.render.limits is not None else None,
                             tools=prompt.tool_count)
    return request_mapping.with_special_tokens(ids, state.engine.tokenizer, prompt.add_special)


def _count_cached(state: ServerState, slo_plan: slo_routing.SloPlan, request_id: str, endpoint: str,
                  priority: Priority, mode: Mode, arrival: float, body: Any) -> None:
    """A level-2 cache answer is a request too: counted (outcome ``cached``) and logged with its level, its usage
    the cached answer's. The SLO guard's signals skip it: no model ran, its latency says nothing of the load."""
    usage = slo_plan.cached_usage
    record = RequestRecord(request_id, endpoint, priority, mode=mode, stream=bool(body.stream), arrival=arrival,
                           outcome="cached", prompt_tokens=usage.get("prompt_tokens", 0),
                           completion_tokens=usage.get("completion_tokens", 0))
    slo_plan.note(record)
    state.metrics.observe(record)


def _check_keeps_sessions(state: ServerState) -> None:
    """keep_session on an engine that keeps no sessions (--max-sessions 0, DeepSeek-V4) would be dropped unseen: a
    400 naming it, as /v1/prefill answers there (a session named without it still runs as any request)."""
    if not state.engine.keeps_sessions:
        raise APIError(400, "keep_session asks to keep this answer's KV in a session, and this server keeps no "
                            "sessions (--max-sessions 0, or a model whose decode state cannot be kept); leave "
                            "keep_session out", "sessions_unsupported", param="keep_session")


def _end_untaken_session(state: ServerState, session: str | None) -> None:
    """A session the completion names ends with it (README), also when no choice can take its KV: else it stayed
    pinned in the arena until its TTL. An engine that keeps no sessions (max_sessions 0, DeepSeek-V4) has none to end:
    the request runs as any (README), never a 400 for the name."""
    if session is not None and state.engine.keeps_sessions:
        state.engine.release_session(session)


async def _checked(state: ServerState, constraint: Constraint | None) -> Constraint | None:
    """Compile the request's constraint before anything is queued (a 400 naming the field when it is bad).
    The first one builds the grammar compiler for this tokenizer (about a second): in a worker thread."""
    if constraint is None:
        return None
    return await asyncio.to_thread(constraints.checked, state.engine.grammar, constraint)


async def _formatter(state: ServerState, top_n: int | None, prompt_n: int | None = None) -> LogprobFormatter | None:
    """The logprob formatter when the request asks for logprobs or prompt_logprobs (None: neither)."""
    if top_n is None and prompt_n is None:
        return None
    compiler = await asyncio.to_thread(lambda: state.engine.grammar)
    tokenizer = state.engine.tokenizer
    return LogprobFormatter(compiler.token_bytes, tokenizer.is_special,
                            decode=lambda tid: tokenizer.decode([tid], skip_special=False))


def _scored_alternatives(output: OutputOptions | None, echoes: list[Echo] | None) -> int | None:
    """Alternatives per prompt token the engine scores: what an echo with logprobs shows, or prompt_logprobs asks
    for, the larger (None: the prompt is not scored)."""
    if output is None:
        return None
    wanted = [n for n in (output.top_logprobs if echoes is not None else None, output.prompt_logprobs)
              if n is not None]
    return max(wanted) if wanted else None


@dataclasses.dataclass
class ResponsePrompt:
    """A /v1/responses body as its template renders it: what create encodes (``usage.input_tokens``) and
    ``POST /v1/responses/input_tokens`` counts, built in one place so the two agree."""

    adapter: str | None  # the LoRA adapter ``model`` names, if any
    previous: StoredResponse | None  # the kept response previous_response_id continues
    turn: list[dict[str, Any]]  # this request's input as chat messages (what its kept response adds)
    functions: responses_tools.FunctionTools
    render: chat_rendering.Rendering
    messages: list[dict[str, Any]]  # as the template gets them (instructions, kept turns, this input)
    listed: list[dict[str, Any]] | None  # the tools the template lists
    size: int  # the characters of text the prompt renders (whether to tokenize it off the event loop)
    tool_count: int  # the tools rendered into the prompt: a context 400 names them


def response_prompt(state: ServerState, body: responses_api.ResponsesRequest, *, within_context: bool) -> ResponsePrompt:
    """The prompt of a /v1/responses body, each bad field a 400 naming it; ``within_context``: a text that alone
    passes the context is a 400 before anything is tokenized (create; a count counts it instead)."""
    adapter = _check_model(state, body.model)
    responses_api.check(body)
    previous = responses_api.previous_response(body, state.responses)
    turn = [{**m, "content": request_mapping.clean_text(m["content"], "input")}
            for m in responses_api.input_messages(body, previous)]
    check_unicode(body)  # the other strings: instructions (rendered), metadata and user (echoed), tools, calls
    messages = responses_api.messages(body, turn, previous)
    texts = responses_api.prompt_texts(messages)
    if within_context:
        prompt_limits.check_texts(texts, state.engine.tokenizer, state.engine.max_seq_len, param="input")
    functions = responses_tools.function_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    given = tool_calls.offered(functions.tools, functions.choice, state.exclude_tools_when_tool_choice_none)
    render = chat_rendering.server_rendering(state, given, body)
    messages, listed = tool_calls.template_messages(messages, functions.tools, render.effective, functions.choice,
                                                    param="input", exclude_none=state.exclude_tools_when_tool_choice_none)
    return ResponsePrompt(adapter, previous, turn, functions, render, messages, listed, sum(map(len, texts)),
                          len(given or ()))


async def encode_response_prompt(state: ServerState, prompt: ResponsePrompt, *, max_tokens: int | None) -> list[int]:
    """The rendered prompt's token ids (long ones off the event loop); ``max_tokens``: a 400 past it."""
    return await _offload(prompt.size, functools.partial(state.tokenizer.encode_chat, prompt.messages,
                                                         tools=prompt.listed, **prompt.render.options(),
                                                         max_tokens=max_tokens),
                          param="input", tools=prompt.tool_count)


@router.post("/v1/responses", responses={**ERROR_RESPONSES, **_STREAM_DOC})
async def create_response(body: responses_api.ResponsesRequest, request: Request) -> Any:
    """OpenAI's Responses API on the chat path: one text output (``responses_api`` says what is refused)."""
    state = _state(request)
    request_id: str = request.scope["state"]["request_id"]
    arrival: float = request.scope["state"].get("t0", time.perf_counter())
    try:
        prompt = response_prompt(state, body, within_context=True)
        adapter, previous, turn, functions, render = (prompt.adapter, prompt.previous, prompt.turn, prompt.functions,
                                                      prompt.render)
        top_n = responses_api.top_logprobs(body, calling=functions.calling)
        text_constraint = responses_api.text_constraint(body)
        call_constraint = tool_calls.tool_constraint(functions.tools, functions.choice,
                                                     parallel=functions.max_calls is None, flat=True)
        if call_constraint is not None and text_constraint is not None:
            raise request_mapping.bad(f"tool_choice {functions.choice.kind.value!r} constrains the output to function "
                                      "calls; it cannot be combined with text.format", "tool_choice")
        constraint = await _checked(state, call_constraint or text_constraint)
        tool_count = prompt.tool_count  # a context 400 names them
        ids = await encode_response_prompt(state, prompt, max_tokens=_prompt_limit(state))
        budget = request_mapping.token_budget(len(ids), body.max_output_tokens, state.sampling_defaults.max_tokens,
                                              context=state.engine.max_seq_len, param="max_output_tokens",
                                              prompt_param="input", tools=tool_count)
        thinking = reasoning.for_prompt(state.think_for(render.effective), ids)
        if top_n is not None and thinking is not None and thinking.thinking:  # its thinking's tokens are no text's
            raise responses_api.logprobs_refused(body, "when the model thinks (serve --reasoning-parser)")
        formatter = await _formatter(state, top_n)
        priority, mode = request_mapping.priority(request.headers)
        # as chat's: what the request leaves out is the model's recommendation (serve --generation-config)
        stops = request_mapping.stop_list(body)
        request_mapping.check_min_tokens(body, [budget])
        request_mapping.check_stop_token_ids(body, _vocab_size(state))
        sampling = request_mapping.sampling_params(body, request_mapping.logit_bias(body, _vocab_size(state)),
                                                   state.sampling_defaults)
        call_format = (tool_calls.call_format(functions.choice, render.effective, state.tool_call_parser)
                       if functions.calling else None)
        engine_request = GenerationRequest(
            prompt_ids=ids, max_tokens=budget, sampling=sampling, priority=priority, mode=mode,
            timeout_s=state.request_timeout, request_id=f"{request_id}#{next(_serial)}", constraint=constraint,
            constraint_after=thinking.constraint_after if thinking is not None and constraint is not None else None,
            adapter=adapter, logprobs=top_n, speculative=body.speculative is not False, cache_salt=body.cache_salt,
            stop=stops, ignore_eos=bool(body.ignore_eos), stop_token_ids=list(body.stop_token_ids or []),
            include_stop_str=bool(body.include_stop_str_in_output), skip_special=body.skip_special_tokens is not False,
            keep_special_ids=tool_calls.kept_special_ids(call_format, state.engine.tokenizer))
        engine, model, slo_plan = state.engine, adapter or state.model_name, None
        if state.slo is not None:  # the SLO ladder, as on the completion routes (no cache)
            slo_plan = await slo_routing.plan(state.slo, body, requests=[engine_request], output=None, chat=True,
                                              priority=priority, mode=mode, n=1, response_id=request_id,
                                              draining=lambda: state.draining, cache=False,
                                              primary_only=adapter is not None,
                                              client_gone=functools.partial(responses.client_left, request))
            engine, model = slo_plan.route.engine, adapter or slo_plan.route.model
        handle = engine.submit(engine_request)
    except UnknownAdapter as e:
        state.metrics.reject("invalid")
        raise _unknown_adapter(e) from None
    except QueueFullError as e:
        raise _queue_full(state, e) from None
    except ClientGone:  # left while held at the SLO gate: no engine took it
        state.metrics.reject("cancelled")
        return responses.client_gone()
    except EngineFailed as e:  # failed between the middleware's check and here (or a fallback's engine did)
        raise _engine_failed(state, e) from None
    except EngineDraining:
        raise _draining(state) from None
    except APIError:
        state.metrics.reject("invalid")
        raise
    except LinesideError as e:
        state.metrics.reject("invalid")
        raise APIError(400, str(e), "invalid_request", param=getattr(e, "param", None)) from None
    record = RequestRecord(request_id, "responses", priority, mode=mode, stream=bool(body.stream), arrival=arrival,
                           prompt_tokens=len(ids))
    if slo_plan is not None:
        slo_plan.note(record)
        state.slo.admitted(handle, mode, fallback=slo_plan.route.fallback)
    options = OutputOptions(chat=True, reasoning=thinking, tools=tuple(functions.tools), named=functions.choice.name,
                            top_logprobs=top_n, formatter=formatter,
                            max_calls=functions.max_calls,
                            call_format=call_format)
    choice = Choice(0, handle, record, options=options)
    builder = responses_api.ResponseBuilder(body, model, request_id, store=state.responses,
                                            conversation=responses_api.conversation(turn, previous), reasoning=thinking,
                                            sampling=sampling, calling=functions.calling)
    if body.stream:
        stream = responses.GenerationStream(responses_api.stream(state, builder, choice), [choice], state)
        if slo_plan is not None:
            stream.headers.update(slo_plan.headers)
        return stream
    failure: APIError | None = None
    try:
        gone = await responses.collect(request, state, [choice])
    except APIError as e:  # the generation failed (collect raises nothing else): kept failed, as OpenAI keeps it
        failure, gone = e, None
    if gone is not None:
        return gone
    split = choice.output.reasoning  # the answer apart from the reasoning (collect fed it), with a reasoning parser
    text = "".join(choice.text_parts) if split is None else split.result()[1] or ""
    content, calls = responses_api.answer(choice.output.calls, text)
    builder.cached_tokens = choice.handle.metrics.prefix_reused_tokens
    if failure is not None:
        raise builder.failed_final(failure, content, (choice.record.prompt_tokens, choice.record.completion_tokens),
                                   split, calls) from None
    if formatter is not None and top_n is not None:
        builder.add_logprobs(formatter.chat(choice.output.logprobs, top_n))
    answer = builder.final(content, (choice.record.prompt_tokens, choice.record.completion_tokens),
                           choice.finish_reason or FinishReason.STOP, split, calls)
    return answer if slo_plan is None or not slo_plan.headers else JSONResponse(answer, headers=slo_plan.headers)


@router.post("/v1/responses/input_tokens", responses=ERROR_RESPONSES)
async def count_response_input_tokens(body: responses_api.ResponsesRequest, request: Request) -> Any:
    """OpenAI's input token count (the SDK's ``responses.input_tokens.count``): the ``usage.input_tokens`` that
    ``POST /v1/responses`` reports for the same body, so a client can budget a conversation before sending it. An
    input past the context is counted, not refused (as /tokenize counts it); every other bad field is create's 400."""
    state = _state(request)
    try:
        prompt = response_prompt(state, body, within_context=False)
        responses_api.text_constraint(body)  # a bad text.format is the same 400 as on create
        ids = await encode_response_prompt(state, prompt, max_tokens=None)
    except LinesideError as e:
        raise APIError(400, str(e), "invalid_request", param=getattr(e, "param", None)) from None
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def get_response(response_id: str, request: Request) -> Any:
    """A response this server kept (``store`` was not false), as it was answered. ``stream=true`` is a 400: OpenAI
    streams only a background response again, and this server makes none (answered with the JSON body, the SDK's
    stream read no events at all); an ``include`` other than the text's logprobs (kept when they were asked for) is
    refused as on create."""
    stored = _state(request).responses.get(response_id)
    if stored is None:
        raise _no_response(response_id)
    query = request.query_params
    for name in query.getlist("include") + query.getlist("include[]"):
        if name != responses_api.TEXT_LOGPROBS:
            raise APIError(400, f"include: {name!r} is not supported (only {responses_api.TEXT_LOGPROBS!r})",
                           "unsupported_parameter", param="include")
    if query.get("stream", "false").lower() not in ("false", "0"):
        raise APIError(400, f"stream: response {response_id!r} is already {stored.status}; only background "
                            "responses stream again, and this server makes none: retrieve it without stream",
                       "unsupported_parameter", param="stream")
    return stored.body


@router.get("/v1/responses/{response_id}/input_items", responses=ERROR_RESPONSES)
async def list_input_items(response_id: str, request: Request) -> Any:
    """A kept response's input items (the SDK's ``responses.input_items.list``), paged by ``after`` / ``limit`` /
    ``order`` as OpenAI pages them; ``include`` is refused as on create."""
    stored = _state(request).responses.get(response_id)
    if stored is None:
        raise _no_response(response_id)
    query = request.query_params
    include = query.getlist("include") + query.getlist("include[]")
    if include:
        raise APIError(400, f"include: {include[0]!r} is not supported", "unsupported_parameter", param="include")
    limit = query.get("limit", "20")
    if not limit.isdigit():
        raise APIError(400, f"limit: {limit!r} is not a whole number from 1 to {response_items.MAX_LIMIT}",
                       "invalid_value", param="limit")
    return response_items.page(stored.input_items, after=query.get("after"), limit=int(limit),
                               order=query.get("order", "desc"))


@router.post("/v1/responses/{response_id}/cancel", responses=ERROR_RESPONSES)
async def cancel_response(response_id: str, request: Request) -> Any:
    """The SDK's ``responses.cancel``: OpenAI cancels only background responses, which this server does not make
    (a kept response has finished), so a kept one is a 400 saying so, as OpenAI answers a synchronous one."""
    stored = _state(request).responses.get(response_id)
    if stored is None:
        raise _no_response(response_id)
    raise APIError(400, f"cannot cancel response {response_id!r}: only background responses can be cancelled, and "
                        f"this one is already {stored.status}", "invalid_request", param="response_id")


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def delete_response(response_id: str, request: Request) -> Any:
    """Forget a kept response (a later previous_response_id naming it gets a 400)."""
    if not _state(request).responses.delete(response_id):
        raise _no_response(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _no_response(response_id: str) -> APIError:
    return APIError(404, f"no response {response_id!r} is kept here (stored with store: false, deleted, or "
                         "dropped: the server keeps only its most recent ones)", "not_found", param="response_id")


# ---- one engine request per choice, then the response ---------------------------------------------------
async def _serve(request: Request, state: ServerState, body: ChatCompletionRequest | CompletionRequest, *,
                 prompts: list[list[int]], budgets: list[int], chat: bool, constraint: Constraint | None = None,
                 output: OutputOptions | None = None, adapter: str | None = None,
                 echoes: list[Echo] | None = None) -> Any:
    """Submit every choice (n per prompt) to the engine and answer with their merged events; ``echoes``: each
    prompt's echo (completions), scored when logprobs are asked for."""
    request_id: str = request.scope["state"]["request_id"]
    arrival: float = request.scope["state"].get("t0", time.perf_counter())
    try:
        priority, mode = request_mapping.priority(request.headers)
        stops = request_mapping.stop_list(body)
        bias = request_mapping.logit_bias(body, _vocab_size(state))
        request_mapping.check_stop_token_ids(body, _vocab_size(state))
        request_mapping.check_min_tokens(body, budgets)
        n = request_mapping.choices_per_prompt(body, len(prompts))
        session = request_mapping.session_id(body, request.headers)
        request_mapping.check_keep_session(body, session, n * len(prompts), adapter)
        if body.keep_session and session is not None:
            _check_keeps_sessions(state)
    except APIError:
        state.metrics.reject("invalid")
        raise
    choices: list[Choice] = []
    endpoint = "chat" if chat else "completions"
    engine, model, slo_plan = state.engine, adapter or state.model_name, None
    response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
    # choice index = prompt * n + copy, as OpenAI orders them; copies share the prompt's cached prefix
    planned: list[tuple[str, int, GenerationRequest]] = []  # (choice id, copy, engine request) in index order
    for prompt_index, (ids, budget) in enumerate(zip(prompts, budgets, strict=True)):
        for copy in range(n):
            index = prompt_index * n + copy
            choice_id = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
            planned.append((choice_id, copy, request_mapping.engine_request(
                ids, budget, body, stops=stops, priority=priority, mode=mode, timeout=state.request_timeout,
                request_id=f"{choice_id}#{next(_serial)}", copy=copy, constraint=constraint,
                logprobs=None if output is None else output.top_logprobs,
                session=session if len(prompts) * n == 1 else None,  # one choice can extend a session
                adapter=adapter, bias=bias, defaults=state.sampling_defaults,
                constraint_after=None if output is None or output.reasoning is None
                else output.reasoning.constraint_after,
                keep_special_ids=tool_calls.kept_special_ids(None if output is None else output.call_format,
                                                             state.engine.tokenizer),
                prompt_logprobs=_scored_alternatives(output, echoes))))
    if state.slo is not None:  # the SLO ladder picks the engine (primary or fallback; the fallback serves the base
        # model only: an adapter's request stays on the primary, gated and marked as the level says, and so does
        # one keeping its session's KV: sessions live in the primary, where /v1/prefill sees them) and may answer
        # from cache
        try:
            slo_plan = await slo_routing.plan(state.slo, body, requests=[r for _, copy, r in planned if copy == 0],
                                              output=output, chat=chat, priority=priority, mode=mode, n=n,
                                              response_id=response_id, draining=lambda: state.draining,
                                              primary_only=adapter is not None or bool(body.keep_session),
                                              client_gone=functools.partial(responses.client_left, request))
        except QueueFullError as e:  # the level-1 batch gate is full: held requests wait as queued ones do
            raise _queue_full(state, e) from None
        except ClientGone:  # left while held at the gate: no engine took it
            state.metrics.reject("cancelled")
            return responses.client_gone()
        if slo_plan.cached is not None:
            _end_untaken_session(state, session)
            _count_cached(state, slo_plan, request_id, endpoint, priority, mode, arrival, body)
            return slo_plan.cached
        engine, model = slo_plan.route.engine, adapter or slo_plan.route.model
    if session is not None and (len(prompts) * n > 1 or adapter is not None or engine is not state.engine):
        _end_untaken_session(state, session)  # no choice takes it (n > 1, an adapter's KV, the fallback's engine)
    try:
        request_mapping.check_capacity(n, len(prompts), engine.capacity)
    except APIError:
        state.metrics.reject("invalid")
        raise
    try:
        handles = engine.submit_all([engine_request for _, _, engine_request in planned])  # all choices or none
        for index, ((_, copy, engine_request), handle) in enumerate(zip(planned, handles, strict=True)):
            record = RequestRecord(request_id, endpoint, priority, mode=mode, stream=bool(body.stream),
                                   arrival=arrival, prompt_tokens=len(engine_request.prompt_ids))
            if slo_plan is not None:
                slo_plan.note(record)
                state.slo.admitted(handle, mode, fallback=slo_plan.route.fallback)
            choices.append(Choice(index, handle, record, copy=copy, options=output,
                                  echo=None if echoes is None else echoes[index // n]))
    except UnknownAdapter as e:
        responses.cancel_all(choices)
        state.metrics.reject("invalid")
        raise _unknown_adapter(e) from None
    except QueueFullError as e:
        responses.cancel_all(choices)
        raise _queue_full(state, e) from None
    except EngineFailed as e:  # failed between the middleware's check and here (or a fallback's engine did)
        responses.cancel_all(choices)
        raise _engine_failed(state, e) from None
    except EngineDraining:
        responses.cancel_all(choices)
        raise _draining(state) from None
    except LinesideError as e:
        responses.cancel_all(choices)
        state.metrics.reject("invalid")
        raise APIError(400, str(e), "invalid_request", param=getattr(e, "param", None)
                       if isinstance(e, ConstraintError) else None) from None
    created = int(time.time())
    if body.stream:
        options = body.stream_options
        writer = sse.ChunkWriter(chat, response_id, created, model=model,
                                 include_usage=bool(options and options.include_usage),
                                 continuous_usage=bool(options and options.continuous_usage_stats))
        stream = responses.GenerationStream(responses.stream_events(state, writer, choices), choices, state)
        if slo_plan is not None:
            stream.headers.update(slo_plan.headers)
        return stream
    response = await responses.complete(request, state, choices, chat=chat, response_id=response_id,
                                        created=created, model=model)
    return response if slo_plan is None else slo_routing.store(state.slo, slo_plan, response)


async def _offload(size: int, fn: Any, *, param: str, renders: TemplateRenders | None = None, tools: int = 0) -> Any:
    """Tokenize long texts in a worker thread so other streams keep flowing; short ones inline (faster). ``renders``:
    ``fn`` renders a request's own template, on those threads whatever its size. A prompt found longer than the
    context while tokenizing is a 400 context_length_exceeded naming ``param`` (and the ``tools`` rendered in it)."""
    try:
        if renders is not None:
            return await renders.run(fn)
        if size > _INLINE_CHARS:
            return await asyncio.to_thread(fn)
        return fn()
    except PromptTooLong as e:
        raise prompt_limits.too_long(e, param=param, tools=tools) from None


def _prompt_limit(state: ServerState) -> int:
    """The most prompt tokens worth encoding: one more and nothing can be generated (token_budget's rule)."""
    return max(int(state.engine.max_seq_len) - 1, 0)


def _vocab_size(state: ServerState) -> int:
    vocab_size = getattr(state.engine, "vocab_size", None)
    return int(vocab_size) if vocab_size else int(state.engine.tokenizer.vocab_size)


# ---- the model this server serves -----------------------------------------------------------------------
def _check_model(state: ServerState, model: str | None) -> str | None:
    """404 model_not_found (as OpenAI, vLLM and Ollama answer) for a model this server does not serve;
    an absent or empty model means the base model. Returns the LoRA adapter ``model`` names, if it names one."""
    if model and model in state.adapter_names and model not in state.served_names:
        return model
    if model and model not in state.served_names:
        served = " or ".join(repr(name) for name in [*state.served_names, *state.adapter_names])
        raise APIError(404, f"model {model!r} is not served here; this server serves {served} "
                            "(send one of those names, or leave 'model' out)", "model_not_found", param="model",
                       type="invalid_request_error")
    return None


def _engine_failed(state: ServerState, e: EngineFailed) -> APIError:
    """A failed engine's refusal, as the middleware answers once it knows (not a shutting-down server's)."""
    state.metrics.reject("engine_failed")
    return APIError(503, f"{e}; retry on another instance", "engine_failed", type="service_unavailable")


def _draining(state: ServerState) -> APIError:
    """The 503 a shutting-down engine's refusal answers (counted as draining): retry on another instance."""
    state.metrics.reject("draining")
    return APIError(503, "server is shutting down and takes no new requests", "draining", headers={"Retry-After": "5"})


def _queue_full(state: ServerState, e: QueueFullError) -> APIError:
    """The 429 a full waiting queue answers (counted as queue_full); Retry-After: the openai client waits that."""
    state.metrics.reject("queue_full")
    return APIError(429, f"the server's waiting queue is full: {e}", "queue_full", headers={"Retry-After": "1"})


def _unknown_adapter(e: Exception) -> APIError:
    return APIError(404, str(e), "model_not_found", param="model", type="invalid_request_error")


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    base = [_card(state, name) for name in state.listed_names]
    return {"object": "list", "data": [*base, *(_card(state, name) for name in state.adapter_names)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: ERROR_RESPONSES[400]})
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    if not model_id:
        raise APIError(404, f"no model named; GET /v1/models lists them, GET /v1/models/{state.model_name} "
                            "shows one", "model_not_found", param="model", type="invalid_request_error")
    _check_model(state, model_id)
    return _card(state, model_id)


def _card(state: ServerState, name: str) -> dict[str, Any]:
    """A model's card; an adapter's names the base model as its ``parent`` (as vLLM's LoRA cards do)."""
    adapter = name in state.adapter_names and name not in state.served_names
    return {"id": name, "object": "model", "created": state.started_at, "owned_by": "lineside",
            "max_model_len": getattr(state.engine, "max_seq_len", None),
            "root": name, "parent": state.model_name if adapter else None}
