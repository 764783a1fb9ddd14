"""OpenAI's Responses API (``POST /v1/responses``) on the chat path: text input and output, ``instructions``,
``text.format`` (json_schema / json_object, grammar-constrained), streaming events. With ``serve
--reasoning-parser`` a reasoning model's thinking is a ``reasoning`` output item (its text as ``reasoning_text``
content, as OpenAI's open-weight models return it) before the message, which holds the answer alone.

Function ``tools`` (``tool_choice``, ``parallel_tool_calls``, ``function_call`` / ``function_call_output`` input
items, ``function_call`` output items) run on chat's tool calling (responses_tools.py, tool_calls.py).

``previous_response_id`` continues a response the server kept (response_store.py; ``store: false`` keeps none).
``reasoning.effort`` renders as chat's reasoning_effort. What this server cannot honour there is a 400 naming the
field: hosted tools (web_search, file_search, ...), ``background``, ``context_management`` (compaction), ``include`` (but
``message.output_text.logprobs``: with ``top_logprobs``, the text's logprobs), ``conversation``, stored ``prompt``
templates, non-text input parts, ``truncation: auto``.
The request and the events follow OpenAI's shapes so the ``openai`` client's ``responses.create`` and
``responses.stream`` read them.
"""

from __future__ import annotations

import reprlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, Field

from lineside.runtime.request import FinishReason
from lineside.runtime.sampling import SamplingParams
from lineside.runtime.structured import Constraint, ConstraintError
from lineside.server import request_mapping, response_items, responses_tools, sse
from lineside.server.errors import APIError
from lineside.server.logprobs import MAX_TOP_LOGPROBS
from lineside.server.reasoning import Reasoning, ReasoningSplitter
from lineside.server.response_store import ResponseStore, StoredResponse
from lineside.server.responses import Choice, failure, observe_finished
from lineside.server.schemas import INT32_MAX, ReasoningEffort
from lineside.server.state import ServerState
from lineside.server.tool_calls import ToolCall, ToolCallDelta, ToolCallStream


class ResponsesRequest(BaseModel):
    # strict as the chat request's fields (schemas.py): no true for 1, no "no" for false
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    model: str | None = None
    input: str | list[Any]  # items: objects, each checked by input_messages (a 400 naming input[i])
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # not OpenAI's here, but chat's: sent, it is honoured
    stream: bool | None = False
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # keep the response for previous_response_id / GET (default true, as OpenAI's)
    user: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None  # functions (responses_tools.py); hosted tool types are refused
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the text's logprobs (TEXT_LOGPROBS too)
    speculative: bool | None = None  # false: this request does not speculate (as chat's)
    # vLLM's sampling extras, checked and honoured as on chat (vLLM's /v1/responses takes them too): left out of
    # the model they were silently dropped and the answer changed
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # any value > 0, as vLLM's
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, as chat's
    # vLLM's extras this server does not do: refused off their defaults (request_mapping.check_unsupported)
    bad_words: Any = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    priority: Any = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's, as chat's: prefix KV shared only within the salt
    # OpenAI's {"effort", "summary"}: the effort reaches the chat template as chat's reasoning_effort does (vLLM's
    # mapping; DeepSeek-V4's template turns thinking on by it); a summary asked for is answered by the full thinking
    reasoning: dict[str, Any] | None = None
    # chat's fields that have no meaning here (one output; logprobs by top_logprobs / include): refused off their
    # defaults, where they were dropped and the client got one output and no logprobs without a word
    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    prompt_logprobs: Any = None
    # refused with a 400 naming them when set
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    context_management: Any = None  # server-side compaction of the conversation
    conversation: Any = None
    prompt: Any = None
    # chat's output constraints: refused (OpenAI: "this parameter has moved to 'text.format'"), not dropped
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @property
    def reasoning_effort(self) -> str | None:
        """``reasoning.effort`` (checked by ``check``), read by the chat rendering as chat's field of that name."""
        return (self.reasoning or {}).get("effort")

    @property
    def reasoning_summary(self) -> str | None:
        """``reasoning.summary``, or its deprecated name ``generate_summary`` (older openai SDKs and clients still
        send it; OpenAI reads it as summary), reported back in the response as ``summary``."""
        reasoning = self.reasoning or {}
        return reasoning.get("summary") if reasoning.get("summary") is not None else reasoning.get("generate_summary")


TEXT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` this server honours
CHAT_CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                    "structured_outputs")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "unsupported_parameter", param=param)


REASONING_SUMMARIES = ("auto", "concise", "detailed")


def _check_reasoning(reasoning: dict[str, Any] | None) -> None:
    """OpenAI's ``reasoning``: ``effort`` one of chat's reasoning_effort values, ``summary`` one of OpenAI's (the
    reasoning item carries the whole thinking, not a summary of it); anything else a 400 naming it."""
    for key, value in (reasoning or {}).items():
        if value is None:
            continue
        if key == "effort" and value not in get_args(ReasoningEffort):
            raise APIError(400, f"reasoning.effort: {value!r} is not one of {', '.join(get_args(ReasoningEffort))}",
                           "invalid_value", param="reasoning.effort")
        if key in ("summary", "generate_summary") and value not in REASONING_SUMMARIES:
            raise APIError(400, f"reasoning.{key}: {value!r} is not one of {', '.join(REASONING_SUMMARIES)}",
                           "invalid_value", param=f"reasoning.{key}")
        if key not in ("effort", "summary", "generate_summary"):
            raise _bad(f"reasoning.{key}: not a reasoning option this server knows; send effort and/or summary",
                       f"reasoning.{key}")


VERBOSITIES = ("low", "medium", "high")


def _check_text(text: dict[str, Any] | None) -> None:
    """OpenAI's ``text``: ``format`` (text_constraint reads it) and ``verbosity`` (low / medium / high: taken and
    echoed, a hint this server does not act on); any other key a 400 naming it: a misspelt ``format`` was dropped
    silently and the output came unconstrained."""
    for key, value in (text or {}).items():
        if key == "verbosity" and value is not None and value not in VERBOSITIES:
            raise APIError(400, f"text.verbosity: {value!r} is not one of {', '.join(VERBOSITIES)}", "invalid_value",
                           param="text.verbosity")
        if key not in ("format", "verbosity"):
            raise _bad(f"text.{key}: not a text option; send format ({{\"type\": \"json_schema\", ...}}) and/or "
                       "verbosity", f"text.{key}")


def check(req: ResponsesRequest) -> None:
    """400 for what this server does not do on /v1/responses, and for metadata past OpenAI's limits."""
    request_mapping.check_metadata(req.metadata)
    request_mapping.check_unsupported(req)
    _check_text(req.text)
    if req.conversation is not None:
        raise _bad("conversation: this server keeps no conversations; send the messages in 'input'", "conversation")
    if req.prompt is not None:
        raise _bad("prompt: stored prompt templates are not supported; send the text in 'input'", "prompt")
    _check_reasoning(req.reasoning)
    if req.background:
        raise _bad("background: background responses are not supported; stream instead", "background")
    for name in req.include or ():
        if name != TEXT_LOGPROBS:
            raise _bad(f"include: {name!r} is not supported (only {TEXT_LOGPROBS!r})", "include")
    if req.context_management:
        raise _bad("context_management: this server does not compact conversations; send a shorter 'input' (or "
                   "start a new chain without previous_response_id) when it nears the context", "context_management")
    if req.truncation not in (None, "disabled"):
        raise _bad("truncation: only 'disabled' (the prompt must fit the context)", "truncation")
    _check_chat_only(req)
    for name in CHAT_CONSTRAINTS:
        if getattr(req, name) is not None:
            raise _bad(f"{name}: not a /v1/responses parameter; give the output's format in 'text.format' "
                       "({\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}} or {\"type\": \"json_object\"})",
                       name)


# chat's fields /v1/responses does not do, each with its value that asks for nothing, and what to send instead
CHAT_ONLY = {
    "n": (1, "a response has one output; send n=1 or leave it out, or ask /v1/chat/completions for n choices"),
    "best_of": (1, "a response has one output; leave it out, or ask /v1/chat/completions or /v1/completions"),
    "logprobs": (False, f"send top_logprobs (0 to {MAX_TOP_LOGPROBS}) and include [\"{TEXT_LOGPROBS}\"], "
                        "as OpenAI's Responses API asks for them"),
    "prompt_logprobs": (None, "the prompt's logprobs are not given here; ask /v1/completions or "
                              "/v1/chat/completions for them"),
}


def _check_chat_only(req: ResponsesRequest) -> None:
    """A 400 naming chat's n / best_of / logprobs / prompt_logprobs when set to ask for something: OpenAI's
    Responses API has none of them and vLLM's drops them, which answered without what the client asked for."""
    for name, (off, instead) in CHAT_ONLY.items():
        value = getattr(req, name)
        if value is not None and not (value == off and type(value) is type(off)):
            raise _bad(f"{name}={reprlib.repr(value)} is not a /v1/responses parameter: {instead}", name)


def top_logprobs(req: ResponsesRequest, *, calling: bool) -> int | None:
    """Alternatives per token of the message text's logprobs (None: none asked for): ``include`` names them or
    ``top_logprobs`` is set. A 400 with function tools, whose calls' tokens are not the message's text."""
    if req.top_logprobs is None and TEXT_LOGPROBS not in (req.include or ()):
        return None
    if calling:
        raise logprobs_refused(req, "with function tools (tool_choice other than 'none')")
    return req.top_logprobs or 0


def logprobs_refused(req: ResponsesRequest, why: str) -> APIError:
    """The 400 for logprobs asked for where the output is not only the message's text (``why``)."""
    param = "top_logprobs" if req.top_logprobs is not None else "include"
    return _bad(f"{param}: the text's logprobs are not given {why}", param)


def input_messages(req: ResponsesRequest, previous: StoredResponse | None = None) -> list[dict[str, Any]]:
    """``input`` as chat messages (text parts only; ``instructions`` apart: a later turn does not inherit them).
    ``function_call`` items are the assistant's ``tool_calls`` (calls next to each other, or after the assistant's
    text, one assistant turn, as the chat message they came from), ``function_call_output`` items ``tool`` messages
    answering a call made before them, here or in ``previous``."""
    out: list[dict[str, Any]] = []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    known = responses_tools.call_ids(previous.conversation) if previous is not None else []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: give each input item as an object (a message {{\"role\", \"content\"}}, "
                                f"a function_call or a function_call_output), not a {type(item).__name__}",
                           "invalid_value", param=where)
        kind = item.get("type", "message")
        if kind == "reasoning":  # an earlier turn's thinking, handed back as OpenAI asks: R1 drops it from history
            continue
        if kind == "function_call":
            call = responses_tools.call_of(item, where)
            known.append(call["id"])
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            out.append(responses_tools.result_of(item, where, known))
            continue
        if kind != "message":
            raise _bad(f"{where}.type: {kind!r} items are not supported; send messages (with text), function_call "
                       "and function_call_output items", f"{where}.type")
        role = item.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"{where}.role: {role!r} is not system, developer, user or assistant", f"{where}.role")
        text = responses_tools.text_of(item.get("content"), f"{where}.content", "the message's text")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    if not out or all(m["role"] == "system" for m in out):
        raise _bad("input: give at least one message", "input")
    return out


def conversation(turn: list[dict[str, Any]], previous: StoredResponse | None) -> list[dict[str, Any]]:
    """The kept conversation this turn continues, then its input (what the turn's own kept response starts with)."""
    return [*(previous.conversation if previous is not None else ()), *turn]


def messages(req: ResponsesRequest, turn: list[dict[str, Any]],
             previous: StoredResponse | None = None) -> list[dict[str, Any]]:
    """What the model reads: this request's ``instructions``, then the conversation."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return [*head, *conversation(turn, previous)]


def prompt_texts(messages: list[dict[str, Any]]) -> list[str]:
    """Every text the prompt renders from ``messages``: contents and the calls' arguments (what bounds its length)."""
    return [*(m["content"] or "" for m in messages),
            *(c["function"]["arguments"] for m in messages for c in m.get("tool_calls") or ()
              if isinstance(c.get("function", {}).get("arguments"), str))]


def answer(calls: ToolCallStream | None, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's message text and calls: all text without function tools; with them, what chat's parser
    reads (text None when the answer is only calls)."""
    if calls is None:
        return text, []
    return calls.finish(text)


def previous_response(req: ResponsesRequest, store: ResponseStore) -> StoredResponse | None:
    """The kept response ``previous_response_id`` names (None without one); a 400 naming it when none is kept."""
    if req.previous_response_id is None:
        return None
    found = store.get(req.previous_response_id)
    if found is None:
        raise APIError(400, f"previous_response_id: no response {req.previous_response_id!r} is kept here (it was "
                            f"stored with store: false, deleted, or dropped: the server keeps its last "
                            f"{store.capacity}); send the whole conversation in 'input'",
                       "previous_response_not_found", param="previous_response_id")
    return found


def text_constraint(req: ResponsesRequest) -> Constraint | None:
    """``text.format``: text (free), json_object, json_schema (``name``, ``schema``, ``strict`` inline)."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object("text.format")
    if kind == "json_schema":
        if "schema" not in fmt:
            raise _bad("text.format.schema: missing; give the JSON schema the output must follow", "text.format.schema")
        try:
            return Constraint.json_schema(fmt["schema"], param="text.format.schema")
        except ConstraintError as e:
            raise APIError(400, str(e), "invalid_value", param=e.param) from None
    raise _bad(f"text.format.type: {kind!r} is not text, json_object or json_schema", "text.format.type")


class ResponseBuilder:
    """The response object and its stream events for one request: a reasoning item first when the output starts in
    a reasoning model's thinking, then the answer's items — one message, or with function tools the message (when
    there is text) and a ``function_call`` item per call. A finished one is kept in ``store`` (unless the request
    says ``store: false``) with the conversation it ends (the answer and its calls, not the reasoning, as the next
    turn's history).

    Streamed, items are added, filled and done one after the other, as OpenAI streams them: text after a call opens
    a new message. With function tools the message opens with the first text (an answer that is only calls has no
    message); without, as soon as the answer starts."""

    def __init__(self, req: ResponsesRequest, model: str, rid: str, *, store: ResponseStore,
                 conversation: list[dict[str, Any]], reasoning: Reasoning | None = None,
                 sampling: SamplingParams | None = None, calling: bool = False):
        """``sampling``: what the request samples with (the model's recommendation where it left a field out), which
        the response names (OpenAI's defaults when not given)."""
        self.req = req
        self.temperature = sampling.temperature if sampling is not None else (
            req.temperature if req.temperature is not None else 1.0)
        self.top_p = sampling.top_p if sampling is not None else req.top_p if req.top_p is not None else 1.0
        # its own id, not the X-Request-Id a client may send (or resend): the store keys the conversation on it
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.rs_id = "rs_" + uuid.uuid4().hex
        self.thinks = reasoning is not None and reasoning.thinking
        self.calling = calling
        self.created = int(time.time())
        self.model = model
        self.seq = 0
        self.store = store if req.store is not False and store.capacity > 0 else None
        self.conversation = tuple(conversation)  # the kept turns before this one + this one's input
        self.input_items = response_items.input_items(req.input)  # ids given now: every listing of it agrees
        # streaming: the item being filled, those done (in output_index order), the next output_index
        self._open: dict[str, Any] | None = None
        self._done: list[dict[str, Any]] = []
        self._next = 1 if self.thinks else 0
        self._valid: set[str] | None = None  # the calls that stand, once the output is complete
        # usage.input_tokens_details.cached_tokens: prompt tokens whose KV came from the prefix cache (the caller sets
        # it from the engine request's metrics before the response is finished)
        self.cached_tokens = 0
        # the message text's token logprobs in OpenAI's shape (when asked for: the caller adds them), and those not
        # yet sent on a delta (a token whose text is held back, part of a character)
        self.logprobs: list[dict[str, Any]] = []
        self._unsent: list[dict[str, Any]] = []

    def add_logprobs(self, entries: list[dict[str, Any]]) -> None:
        self.logprobs += entries
        self._unsent += entries

    def final(self, content: str | None, usage: tuple[int, int], finish_reason: FinishReason,
              split: ReasoningSplitter | None = None, calls: list[ToolCall] | None = None) -> dict[str, Any]:
        """The finished response (completed, or incomplete at max_output_tokens), kept when it is to be;
        ``content``: the answer's text (None: the answer is only ``calls``); ``split``: the output's reasoning,
        when it started in it."""
        calls = calls or []
        status = "incomplete" if finish_reason == FinishReason.LENGTH else "completed"
        # after a reasoning item, a message only when the answer has text (OpenAI, vLLM)
        message = [] if content is None or (self.thinks and not content) else [self.item(content, status)]
        return self._finished([*message, *(responses_tools.call_item(c) for c in calls)], content, calls, usage,
                              finish_reason, split)

    def _finished(self, answer: list[dict[str, Any]], content: str | None, calls: list[ToolCall],
                  usage: tuple[int, int], finish_reason: FinishReason,
                  split: ReasoningSplitter | None) -> dict[str, Any]:
        incomplete = finish_reason == FinishReason.LENGTH
        body = self.body("incomplete" if incomplete else "completed", usage,
                         "max_output_tokens" if incomplete else None, split, answer)
        self._keep(body, content, calls)
        return body

    def _keep(self, body: dict[str, Any], content: str | None, calls: list[ToolCall]) -> None:
        """Keep the response (unless ``store: false``) with the conversation it ends: its input, then its answer (none
        when a failed one produced nothing)."""
        if self.store is None:
            return
        turn = (responses_tools.assistant_turn(content, calls),) if content or calls else ()
        self.store.put(self.id, StoredResponse(body, (*self.conversation, *turn), self.input_items))

    def _failed(self, error: APIError, usage: tuple[int, int], split: ReasoningSplitter | None,
                answer: list[dict[str, Any]]) -> dict[str, Any]:
        """The failed response, kept as OpenAI keeps one (GET finds it ``failed``, with its error and the output and
        usage so far). The error's ``code`` is ``server_error`` (the SDK's ``ResponseError.code`` is an enum that has
        none of this server's codes); its ``type`` says which failure."""
        body = self.body("failed", usage, None, split, answer)
        body["error"] = {"code": "server_error", "message": error.message, "type": error.type, "param": error.param}
        texts = [i["content"][0]["text"] for i in answer if i["type"] == "message"]
        calls = [ToolCall(i["name"], i["arguments"], i["call_id"]) for i in answer
                 if i["type"] == "function_call" and i["status"] == "completed"]
        self._keep(body, "".join(texts) if texts else None, calls)
        return body

    def failed_final(self, error: APIError, content: str | None, usage: tuple[int, int],
                     split: ReasoningSplitter | None = None, calls: list[ToolCall] | None = None) -> APIError:
        """A non-streamed response whose generation failed: kept failed with what was produced (``content``, the
        ``calls`` that stand), and the error to answer, which names the kept response (the client has no other way
        to learn its id)."""
        message = [] if not content else [self.item(content, "incomplete")]
        self._failed(error, usage, split, [*message, *(responses_tools.call_item(c) for c in calls or ())])
        if self.store is None:
            return error
        return APIError(error.status, f"{error.message} (the response so far is kept as failed: GET /v1/responses/"
                                      f"{self.id})", error.code, param=error.param, type=error.type,
                        headers=error.headers)

    def body(self, status: str, usage: tuple[int, int] | None, reason: str | None = None,
             split: ReasoningSplitter | None = None, answer: list[dict[str, Any]] = ()) -> dict[str, Any]:
        r = self.req
        fmt = (r.text or {}).get("format") or {"type": "text"}
        item_status = "completed" if status == "completed" else "incomplete"
        thought = [] if split is None or not self.thinks else [self.reasoning_item(
            split.result()[0] or "", item_status if split.thinking else "completed")]
        output = [] if status == "in_progress" else [*thought, *answer]
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            # OpenAI's: when it completed, only once completed (null while in progress, incomplete or failed)
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model, "output": output, "instructions": r.instructions,
            "error": None, "incomplete_details": {"reason": reason} if reason else None,
            "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": self.req.reasoning_effort, "summary": self.req.reasoning_summary}, "store": self.store is not None, "temperature": self.temperature,
            "text": {"format": fmt, "verbosity": (r.text or {}).get("verbosity") or "medium"}, "tool_choice": "auto" if r.tool_choice is None else r.tool_choice,
            "tools": responses_tools.echoed_tools(r.tools),
            "top_p": self.top_p, "truncation": "disabled", "user": r.user, "top_logprobs": r.top_logprobs,
            "usage": None if usage is None else {
                "input_tokens": usage[0],
                "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": usage[1], "output_tokens_details": {
                    "reasoning_tokens": split.reasoning_tokens if split is not None else 0},
                "total_tokens": usage[0] + usage[1]},
        }

    def item(self, text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
        return {"type": "message", "id": item_id or self.msg_id, "status": status, "role": "assistant",
                "content": [self.part(text, self.logprobs)]}

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.rs_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}

    @staticmethod
    def part(text: str, logprobs: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """An output_text part (``logprobs``: its tokens', when asked for; only a response without function tools
        or thinking has them, so its one message)."""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event (``event:`` line + ``data:``), numbered as OpenAI numbers them."""
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {sse.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        """created / in_progress, then the first item: the reasoning when the output starts in it, else the message
        (unless function tools open it with the first text)."""
        body = self.body("in_progress", None)
        head = [self.event("response.created", response=body), self.event("response.in_progress", response=body)]
        if not self.thinks:
            return [*head, *self.answer_opening()]
        return [*head, self.event("response.output_item.added", output_index=0,
                                  item={"type": "reasoning", "id": self.rs_id, "summary": [], "status": "in_progress",
                                        "content": [], "encrypted_content": None}),
                self.event("response.content_part.added", item_id=self.rs_id, output_index=0, content_index=0,
                           part={"type": "reasoning_text", "text": ""})]

    def answer_opening(self) -> list[str]:
        """Where the answer starts: its message opens, unless function tools open it with the first text, or the
        output began with reasoning: then its first text opens it (none when the answer has none)."""
        return [] if self.calling or self.thinks else self._open_message()

    def _open_message(self) -> list[str]:
        item_id = self.msg_id if not any(i["type"] == "message" for i in self._done) else "msg_" + uuid.uuid4().hex
        self._open = {"type": "message", "id": item_id, "index": self._next, "text": []}
        self._next += 1
        return [self.event("response.output_item.added", output_index=self._open["index"],
                           item={"type": "message", "id": item_id, "status": "in_progress", "role": "assistant",
                                 "content": []}),
                self.event("response.content_part.added", item_id=item_id, output_index=self._open["index"],
                           content_index=0, part=self.part(""))]

    def reasoning_delta(self, text: str) -> str:
        return self.event("response.reasoning_text.delta", item_id=self.rs_id, output_index=0, content_index=0,
                          delta=text)

    def reasoning_closing(self, text: str, status: str) -> list[str]:
        return [self.event("response.reasoning_text.done", item_id=self.rs_id, output_index=0, content_index=0,
                           text=text),
                self.event("response.content_part.done", item_id=self.rs_id, output_index=0, content_index=0,
                           part={"type": "reasoning_text", "text": text}),
                self.event("response.output_item.done", output_index=0, item=self.reasoning_item(text, status))]

    def delta(self, text: str) -> list[str]:
        """The answer's text: into the open message, or a message opened for it (after a call)."""
        out = [] if self._open is not None and self._open["type"] == "message" else [*self._close(), *self._open_message()]
        self._open["text"].append(text)
        out.append(self.event("response.output_text.delta", item_id=self._open["id"], output_index=self._open["index"],
                              content_index=0, delta=text, logprobs=self._unsent))
        self._unsent = []
        return out

    def call_delta(self, d: ToolCallDelta) -> list[str]:
        """A piece of a call: its first opens its ``function_call`` item (closing the one before), the rest are its
        arguments."""
        out: list[str] = []
        if d.id is not None:
            out += self._close()
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": d.id, "name": d.name,
                    "arguments": "", "status": "in_progress"}
            self._open = {"type": "function_call", "index": self._next, "item": item}
            self._next += 1
            out.append(self.event("response.output_item.added", output_index=self._open["index"], item=dict(item)))
        if d.arguments and self._open is not None and self._open["type"] == "function_call":
            self._open["item"]["arguments"] += d.arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=self._open["item"]["id"],
                                  output_index=self._open["index"], delta=d.arguments))
        return out

    def calls_settled(self, calls: list[ToolCall]) -> None:
        """The output is complete and these are its calls: an item opened for any other (it turned out malformed:
        cut off, not JSON) is done ``incomplete`` and left out of the response, its text the message's."""
        self._valid = {c.id for c in calls}

    def _close(self, status: str = "completed") -> list[str]:
        """The open item's done events (none open: nothing)."""
        o, self._open = self._open, None
        if o is None:
            return []
        if o["type"] == "function_call":
            valid = self._valid is None or o["item"]["call_id"] in self._valid
            item = {**o["item"], "status": "completed" if valid else "incomplete"}
            self._done.append(item)
            return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=o["index"],
                               name=item["name"], arguments=item["arguments"]),  # name: in OpenAI's spec, not all types
                    self.event("response.output_item.done", output_index=o["index"], item=item)]
        text = "".join(o["text"])
        item = self.item(text, status, o["id"])
        self._done.append(item)
        # logprobs of tokens whose text never came (the output ended inside a character) go on an empty delta
        flush = [self.event("response.output_text.delta", item_id=o["id"], output_index=o["index"], content_index=0,
                            delta="", logprobs=self._unsent)] if self._unsent else []
        self._unsent = []
        return [*flush, self.event("response.output_text.done", item_id=o["id"], output_index=o["index"], content_index=0,
                           text=text, logprobs=self.logprobs),
                self.event("response.content_part.done", item_id=o["id"], output_index=o["index"], content_index=0,
                           part=self.part(text, self.logprobs)),
                self.event("response.output_item.done", output_index=o["index"], item=item)]

    def closing(self, usage: tuple[int, int], finish_reason: FinishReason, split: ReasoningSplitter | None = None,
                calls: list[ToolCall] | None = None) -> list[str]:
        """The last item's done events, then completed (or incomplete): the response holds the items streamed (an
        empty message when the answer had nothing and no reasoning came before it), less the calls that did not
        stand."""
        calls = calls or []
        out = [] if self._done or self._open is not None or self.thinks else self._open_message()
        out += self._close("incomplete" if finish_reason == FinishReason.LENGTH else "completed")
        answer = [i for i in self._done if i["type"] != "function_call" or i["status"] == "completed"]
        texts = [i["content"][0]["text"] for i in answer if i["type"] == "message"]
        content = "".join(texts) if texts else None
        body = self._finished(answer, content, calls, usage, finish_reason, split)
        return [*out, self.event(f"response.{body['status']}", response=body)]

    def failed(self, error: APIError, usage: tuple[int, int], split: ReasoningSplitter | None = None) -> list[str]:
        """The open item's done events (``incomplete``: the output stopped inside it), then failed with the output
        and usage so far, as OpenAI ends a failed stream (and keeps it: ``_failed``)."""
        self._valid = {i["call_id"] for i in self._done if i["type"] == "function_call"}  # an open call is cut off
        out = self._close("incomplete")
        body = self._failed(error, usage, split, list(self._done))
        return [*out, self.event("response.failed", response=body)]


async def stream(state: ServerState, builder: ResponseBuilder, choice: Choice) -> AsyncIterator[str]:
    """The SSE body of a streamed response: created / in_progress, the reasoning item's events when the output
    starts in it, then the answer's items (a message's text deltas, a function_call's arguments deltas, each
    item's done events before the next is added), then completed (or incomplete at max_output_tokens; failed on an
    engine failure)."""
    for e in builder.opening():
        yield e
    splitter = choice.output.reasoning if builder.thinks else None
    calls = choice.output.calls  # None: no function tools (or tool_choice none), the answer is the message's text
    options = choice.output.options  # top_logprobs and its formatter when the text's logprobs are asked for
    reasoning: list[str] = []
    answering = splitter is None
    async for event in choice.handle:
        choice.note(event, time.perf_counter())
        if options.formatter is not None and options.top_logprobs is not None:
            builder.add_logprobs(options.formatter.chat(event.logprobs, options.top_logprobs))
        thought, answer = ("", event.text) if splitter is None else splitter.feed(event.text, event.token_ids,
                                                                                   event.held_chars)
        if splitter is not None and event.finish_reason is not None:
            thought += splitter.close()[0]
        if thought:
            reasoning.append(thought)
            yield builder.reasoning_delta(thought)
        if not answering and (splitter is not None and not splitter.thinking or event.finish_reason is not None):
            answering = True
            status = "incomplete" if event.finish_reason not in (None, FinishReason.STOP) and splitter.thinking \
                else "completed"
            for e in [*builder.reasoning_closing("".join(reasoning), status), *builder.answer_opening()]:
                yield e
        for e in _answer_events(builder, calls, answer, event.finish_reason is not None):
            yield e
        if event.finish_reason is None:
            continue
        observe_finished(state.metrics, [choice])
        if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            builder.cached_tokens = choice.handle.metrics.prefix_reused_tokens
            for e in builder.closing((choice.record.prompt_tokens, choice.record.completion_tokens),
                                     event.finish_reason, splitter, calls.calls if calls is not None else None):
                yield e
        else:
            for e in builder.failed(failure(state, event), (choice.record.prompt_tokens,
                                                            choice.record.completion_tokens), splitter):
                yield e
        return


def _answer_events(builder: ResponseBuilder, calls: ToolCallStream | None, answer: str, last: bool) -> list[str]:
    """The events for a piece of the answer: its text, or with function tools its text and call pieces as chat's
    parser reads them (``last``: the output is complete, so the calls are settled and a malformed one's text is
    the message's)."""
    if calls is None:
        return builder.delta(answer) if answer else []
    pieces = [calls.feed(answer)] if answer else []
    if last:
        pieces.append(calls.close())
        builder.calls_settled(calls.calls)
        pieces = [(text, [d for d in deltas if d.index < len(calls.calls)]) for text, deltas in pieces]
    out: list[str] = []
    for text, deltas in pieces:
        if text:
            out += builder.delta(text)
        for d in deltas:
            out += builder.call_delta(d)
    return out
