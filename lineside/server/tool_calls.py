"""OpenAI tool calling: tools and tool_choice checked, tool history rendered through the chat template,
the model's own call formats parsed (streaming too) into OpenAI ``tool_calls``.

``required`` and a named function are grammar-constrained (``tool_constraint``): a named call makes the
model write the function's arguments as JSON for its parameter schema; ``required`` makes it write
``[{"name": ..., "arguments": {...}}, ...]`` over the tools' schemas. ``auto`` lets the model choose and
parses what it writes: Qwen2.5 / R1-Distill-Qwen / Hermes ``<tool_call>{json}</tool_call>`` (or a JSON array of
calls in the tags, as SmolLM2 was trained to write), Llama 3.x's bare JSON ``{"name": ..., "parameters": {...}}`` or
Mistral's ``[TOOL_CALLS]`` (a JSON array after it, or ``name[ARGS]{...}``). A template that knows nothing of tools (SmolLM2's) gets
the tools described in a system message (in the first user turn when it refuses a system role, as Gemma's does),
asking for the ``<tool_call>`` format.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from lineside.runtime.chat_template import (
    alternates,
    refuses_user_after_tool,
    shows_system,
    system_only_with_last_user,
)
from lineside.runtime.stop import partial_suffix
from lineside.runtime.structured import (
    MAX_SCHEMA_DEPTH,
    Constraint,
    ConstraintError,
    check_depth,
    check_enforceable,
)
from lineside.server.errors import APIError

# ``required`` with parallel calls: at most this many in one answer. A small model given an open array
# repeats its call until max_tokens and the last one is cut mid-arguments; a bound keeps every call whole.
MAX_PARALLEL_CALLS = 4
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
_DECODER = json.JSONDecoder()


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_value", param=param)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments
    # the tool object as a chat request sent it (its keys, their order, "strict"): what the chat template lists, as
    # transformers' apply_chat_template renders the client's dicts; None for /v1/responses' flat tools
    sent: dict[str, Any] | None = field(default=None, compare=False)

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's chat shape, every field filled (this server's own descriptions of the tools)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def listed(self) -> dict[str, Any]:
        """What a chat template gets for this tool: the client's object as sent (a template that writes tools with
        ``tojson`` writes what transformers writes), else the OpenAI shape."""
        return self.sent if self.sent is not None else self.openai()


class ToolChoiceKind(str, Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolChoice:
    kind: ToolChoiceKind
    name: str | None = None  # the function, when NAMED


class CallFormat(str, Enum):
    """How the model's output carries calls."""

    TAGGED = "tagged"  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen2.5, Hermes)
    JSON = "json"  # bare JSON objects or an array of them (Llama 3.x; the ``required`` grammar)
    ARGUMENTS = "arguments"  # the whole output is one call's arguments (a named function's grammar)
    MISTRAL = "mistral"  # [TOOL_CALLS] [{"name": ..., "arguments": ...}] (v3) or [TOOL_CALLS]name[ARGS]{...} (v11+)
    # DeepSeek's markup between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each call in <｜tool▁call▁begin｜>
    # ... <｜tool▁call▁end｜>: V3 / R1 (and R1-Distill's templates) write function<｜tool▁sep｜>NAME\n```json\n{...}\n```,
    # V3.1 NAME<｜tool▁sep｜>{...}
    DEEPSEEK_V3 = "deepseek_v3"
    DEEPSEEK_V31 = "deepseek_v31"
    # DeepSeek-V3.2 / V4's DSML markup, written by their Python encoders (encoding_dsv32.py / encoding_dsv4.py in the
    # model repos; no Jinja template): a block <｜DSML｜function_calls> (V3.2) / <｜DSML｜tool_calls> (V4) holding
    # <｜DSML｜invoke name="NAME"> ... </｜DSML｜invoke> per call, each argument
    # <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter> (true: the text as is; false: JSON)
    DEEPSEEK_V32 = "deepseek_v32"
    DEEPSEEK_V4 = "deepseek_v4"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a call: the first carries id and name (arguments ""), later ones arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "function": {"arguments": self.arguments}}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
            d["function"]["name"] = self.name
        return d


# ---- request side ----------------------------------------------------------------------------------------
def parse_tools(tools: Sequence[Any] | None, param: str = "tools", *, flat: bool = False) -> list[Tool]:
    """OpenAI ``tools`` → typed tools; a 400 naming the entry for a malformed one or a name used twice.
    ``flat``: the Responses API's shape, ``{"type": "function", "name": ..., "parameters": ...}`` (chat's nests the
    function under ``"function"``); any other type there is a hosted tool (web_search, file_search, ...), a 400."""
    out: list[Tool] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(tools or []):
        where = f"{param}[{i}]"
        if flat:
            if not isinstance(t, dict):
                raise _bad(f"{where}: each tool is an object, {{\"type\": \"function\", \"name\": ..., "
                           "\"parameters\": {...}}", where)
            kind = t.get("type")
            if kind != "function":
                raise APIError(400, f"{where}.type: {kind!r} tools are not supported; this server runs the model "
                                    "alone and calls no hosted tools: give functions, {\"type\": \"function\", "
                                    "\"name\": ..., \"parameters\": {...}}", "unsupported_value", param=f"{where}.type")
            f, at = t, where
            if "name" not in f and isinstance(f.get("function"), dict):
                raise _bad(f"{where}.name: missing; on /v1/responses a function tool is {{\"type\": \"function\", "
                           "\"name\": ..., \"parameters\": {...}}, not nested under \"function\" as chat's",
                           f"{where}.name")
        else:
            if (not isinstance(t, dict) or t.get("type", "function") != "function"
                    or not isinstance(t.get("function"), dict)):
                raise _bad(f"{where}: each tool must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
            f, at = t["function"], f"{where}.function"
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{at}.name: a function name is 1-64 letters, digits, '_', '.' or '-'", f"{at}.name")
        if name in seen:
            raise _bad(f"{at}.name: {name!r} is already the name of {param}[{seen[name]}]; "
                       "tool names must be unique", f"{at}.name")
        seen[name] = i
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"{at}.parameters: must be a JSON schema object", f"{at}.parameters")
        desc = f.get("description") or ""
        if not isinstance(desc, str):
            raise _bad(f"{at}.description: must be a string", f"{at}.description")
        # As sent, but with the parameters OpenAI reads into a function sent without any (none: an empty list of
        # arguments): templates that walk tool.function.parameters.properties (Hermes-style) raise without the key
        sent = None if flat else t if "parameters" in f else {**t, "function": {**f, "parameters": params}}
        out.append(Tool(name, desc, params, sent=sent))
    return out


def parse_tool_choice(choice: Any, tools: Sequence[Tool], param: str = "tool_choice", *,
                      flat: bool = False) -> ToolChoice:
    """OpenAI ``tool_choice`` (default: auto with tools, none without). ``flat``: the Responses API's shape, where
    a named function is ``{"type": "function", "name": ...}`` (chat's: ``{"function": {"name": ...}}``)."""
    if choice is None:
        return ToolChoice(ToolChoiceKind.AUTO if tools else ToolChoiceKind.NONE)
    named = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad(f"{param}: {choice!r} is not none, auto, required or {named}", param)
        kind = ToolChoiceKind(choice)
        if kind == ToolChoiceKind.AUTO and not tools:  # auto with nothing to call: plain text, as clients expect
            return ToolChoice(ToolChoiceKind.NONE)
        if kind == ToolChoiceKind.REQUIRED and not tools:
            raise _bad(f"{param} {choice!r} asks for a tool call but no tools are given; give the functions in 'tools'",
                       param)
        return ToolChoice(kind)
    name = None
    kind = choice.get("type", "function") if isinstance(choice, dict) else None
    if kind == "function":
        inner = choice if flat else choice.get("function")
        name = inner.get("name") if isinstance(inner, dict) else None
    elif kind is not None:  # allowed_tools, a hosted tool, mcp, custom: this server has functions only
        raise _bad(f"{param}: type {kind!r} is not supported; give none, auto, required or {named}", param)
    if not isinstance(name, str):
        raise _bad(f"{param}: a named choice is {named}", param)
    if name not in {t.name for t in tools}:
        raise _bad(f"{param}: function {name!r} is not in tools ({', '.join(t.name for t in tools) or 'none given'})",
                   param)
    return ToolChoice(ToolChoiceKind.NAMED, name)


def tool_constraint(tools: Sequence[Tool], choice: ToolChoice, parallel: bool = True, *,
                    flat: bool = False) -> Constraint | None:
    """The grammar for ``required`` / a named function; None for auto and none (the model is free). ``flat``: the
    tools came in the Responses API's shape (a bad schema is named ``tools[i].parameters``)."""
    if choice.kind == ToolChoiceKind.NAMED:
        tool = next(t for t in tools if t.name == choice.name)
        where = "" if flat else ".function"
        try:
            return Constraint.json_schema(_object_schema(tool.parameters),
                                          param=f"tools[{tools.index(tool)}]{where}.parameters")
        except ConstraintError as e:
            raise _bad(str(e), e.param or "tools") from None
    if choice.kind != ToolChoiceKind.REQUIRED:
        return None
    at = "#/items/properties/arguments" if len(tools) == 1 else "#/items/anyOf/{}/properties/arguments"
    for i, t in enumerate(tools):  # named by the tool, not by where the grammar below nests its parameters
        try:
            where = f"tools[{i}]{'' if flat else '.function'}.parameters"
            # before ``rerooted`` recurses through it; the levels the pointer ``at`` names wrap the parameters
            check_depth(t.parameters, where, MAX_SCHEMA_DEPTH - at.count("/"))
            check_enforceable(t.parameters, where)
        except ConstraintError as e:
            raise _bad(str(e), e.param or "tools") from None
    calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                               "arguments": rerooted(_object_schema(t.parameters), at.format(i))},
              "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1,
                              "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
    return Constraint.json_schema(schema, param="tools")


def _object_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema: a call's arguments are a JSON object, so a schema that names no type ({}, properties
    without ``"type": "object"``, a bare ``$schema``) is made one; under it the grammar could write a string. Formats
    the grammar engine cannot enforce are left out when it is compiled (runtime/schema_formats)."""
    return parameters if "type" in parameters else {**parameters, "type": "object"}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are JSON data, not schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def rerooted(schema: Any, at: str, *, names: bool = False) -> Any:
    """``schema`` with its local refs (``#``, ``#/$defs/X``, ``#/definitions/X``, any ``#/...`` pointer) moved
    to ``at``, the pointer where it now sits inside a larger schema: refs resolve from the document's root, so a
    tool's parameters wrapped by the ``required`` grammar would otherwise refer to nothing (pydantic-made tools
    keep their nested models in ``$defs``). A copy; the tool's own schema is left as the request gave it.
    ``names``: ``schema`` maps names to schemas (``properties``), so a key such as "enum" is a name there."""
    if isinstance(schema, list):
        return [rerooted(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {key: rerooted(value, at) for key, value in schema.items()}
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rerooted(value, at, names=key in _NAMED_SCHEMAS)
    return out


# ``--tool-call-parser`` (vLLM's names): how ``auto`` reads the model's calls; ``auto`` infers it from the template.
PARSERS = {"auto": None, "hermes": CallFormat.TAGGED, "llama3_json": CallFormat.JSON, "mistral": CallFormat.MISTRAL,
           "deepseek_v3": CallFormat.DEEPSEEK_V3, "deepseek_v31": CallFormat.DEEPSEEK_V31,
           "deepseek_v32": CallFormat.DEEPSEEK_V32, "deepseek_v4": CallFormat.DEEPSEEK_V4}


def call_format(choice: ToolChoice, chat_template: str | None, parser: str = "auto") -> CallFormat:
    """Where the calls are in this output: fixed by the grammar for required / named, else the model's own —
    ``parser``'s format, or (auto) the one the chat template writes: DeepSeek's ``<｜tool▁call▁begin｜>`` markup (V3's
    with a fenced ```json block, else V3.1's), Mistral's ``[TOOL_CALLS]``, ``<tool_call>`` tags (Qwen2.5, Hermes,
    SmolLM2's ``<tool_call>[...]</tool_call>``) or, for a template with tools and no tags, Llama 3.x's bare JSON."""
    if choice.kind == ToolChoiceKind.NAMED:
        return CallFormat.ARGUMENTS
    if choice.kind == ToolChoiceKind.REQUIRED:
        return CallFormat.JSON
    if PARSERS.get(parser) is not None:
        return PARSERS[parser]
    t = chat_template or ""
    for fmt, (block, _end) in _DSML_BLOCKS.items():  # a port of V3.2's / V4's encoder writing their DSML block
        if block in t:
            return fmt
    if _DS_CALL in t:  # DeepSeek V3 / R1 / R1-Distill / V3.1: the template writes past calls in the markup
        return CallFormat.DEEPSEEK_V3 if "```json" in t else CallFormat.DEEPSEEK_V31
    if _MISTRAL_CALLS in t:
        return CallFormat.MISTRAL  # Mistral 7B v0.3, Nemo, Small: the template writes past calls after the marker
    if "<tool_call>" in t or not template_knows_tools(t):
        return CallFormat.TAGGED  # Qwen / Hermes, and what the fallback system prompt asks for
    return CallFormat.JSON  # Llama 3.x: {"name": ..., "parameters": ...}


def kept_special_ids(fmt: CallFormat | None, tokenizer: Any) -> frozenset[int]:
    """The ids of the markers ``fmt``'s parser reads that are special tokens of ``tokenizer`` (Mistral's
    ``[TOOL_CALLS]``, ``[ARGS]``, ``[CALL_ID]`` in v3+ tokenizers): the detokenizer keeps their text, else v11+
    calls came out as ``get_weather{...}`` and were no calls (vLLM keeps special tokens for its Mistral parser).
    Other special tokens stay out of the text. DeepSeek's ``<｜tool▁calls▁begin｜>``, ``<｜tool▁call▁begin｜>``,
    ``<｜tool▁sep｜>``, ... likewise, for its formats (vLLM's deepseek parsers read them in the text)."""
    if fmt == CallFormat.MISTRAL:
        markers: tuple[str, ...] = (_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_ID)
    elif fmt in (CallFormat.DEEPSEEK_V3, CallFormat.DEEPSEEK_V31):
        markers = _DS_MARKERS
    elif fmt in _DSML_BLOCKS:
        markers = (*_DSML_BLOCKS[fmt], _DSML, _DSML_INVOKE_END, _DSML_PARAM_END)
    else:
        return frozenset()
    ids = (tokenizer.token_id(t) for t in markers)
    return frozenset(i for i in ids if i is not None and tokenizer.is_special(i))


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def offered(tools: Sequence[Tool], choice: ToolChoice, exclude_none: bool = False) -> list[dict[str, Any]] | None:
    """The tools a chat template is given; with some, a bundle's "tool_use" template renders (chat_rendering).
    tool_choice none still lists them (the model is told of tools it may not call now, as OpenAI and vLLM render
    them); ``exclude_none`` (serve --exclude-tools-when-tool-choice-none, vLLM's flag) leaves them out then."""
    if not tools or (exclude_none and choice.kind == ToolChoiceKind.NONE):
        return None
    return [t.listed() for t in tools]


def template_messages(messages: list[dict[str, Any]], tools: Sequence[Tool], chat_template: str | None,
                      choice: ToolChoice, param: str = "messages", *,
                      exclude_none: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. Assistant ``tool_calls`` get their arguments as objects (what
    HF templates expect; as the client's text for a template that joins them to strings with ``+``, R1-Distill's);
    a template without tool support gets tools, calls and results written as text. A template that writes past calls
    in DeepSeek's markup but has no tools section (R1-Distill's) renders calls and results itself, the tools described
    in a system message asking for that markup. ``param``: the request field holding the messages, named by a 400;
    ``exclude_none``: as offered's."""
    listed = offered(tools, choice, exclude_none)
    ds_markup = _DS_CALL in (chat_template or "")
    deepseek = ds_markup and not template_knows_tools(chat_template)
    if template_knows_tools(chat_template) or deepseek:
        short = bool(_NINE_CHAR_IDS.search(chat_template or ""))
        as_text = bool(_JOINED_ARGUMENTS.search(chat_template or ""))
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_template_call(c, as_text) for c in m["tool_calls"]]
                if ds_markup and not m.get("content"):  # DeepSeek's templates write the calls only for content
                    m["content"] = None  # none (as OpenAI's message has it); for "" they left them out of the prompt
                if short:
                    m["tool_calls"] = [{**c, "id": _nine_chars(c["id"])} for c in m["tool_calls"]]
            if short and m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
                m["tool_call_id"] = _nine_chars(m["tool_call_id"])
            out.append(m)
        _check_user_after_tool(out, chat_template, param)
        if deepseek and listed:
            out = _with_tools_text(out, deepseek_tools_prompt(tools, v3="```json" in (chat_template or "")),
                                   chat_template)
        return _system_kept(_alternating(out, chat_template), chat_template, param), listed
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps(_template_call(c)['function'], ensure_ascii=False)}\n"
                              "</tool_call>" for c in m.pop("tool_calls"))
            m["content"] = ((m.get("content") or "") + "\n" + calls).strip()
        elif m.get("role") == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if i and messages[i - 1].get("role") == "tool":  # results in a row share one user turn, as Qwen2.5's
                out[-1]["content"] += "\n" + response  # and Hermes' templates write them (and Gemma's alternation
                continue  # of user and assistant turns holds)
            m = {"role": "user", "content": response}
        out.append(m)
    if listed:
        out = _with_tools_text(out, tools_system_prompt(tools), chat_template)
    return _system_kept(_alternating(out, chat_template), chat_template, param), None


def _check_user_after_tool(messages: list[dict[str, Any]], chat_template: str | None, param: str) -> None:
    """A 400 saying what to send for a user message right after a tool result where the template refuses it
    (Mistral-7B-Instruct-v0.3's: "conversation roles must alternate", though the client's roles do); the result
    is its own [TOOL_RESULTS] block there, so unlike user → user there is no turn to join the text to."""
    if not chat_template:
        return
    at = next((i for i in range(1, len(messages))
               if messages[i].get("role") == "user" and messages[i - 1].get("role") == "tool"), None)
    if at is None or not refuses_user_after_tool(chat_template):
        return
    where = f"{param}[{at}]" if param == "messages" else param
    raise _bad(f"{where}: this model's chat template takes no user message right after a tool result; send the "
               "assistant's answer to the tool result (an assistant message) before it, or send the tool result "
               "and let the model answer first", param)


def _system_kept(messages: list[dict[str, Any]], chat_template: str | None, param: str) -> list[dict[str, Any]]:
    """The system text in the last user turn (as mistral_common places it) for a template that writes it only when
    the conversation ends with a user turn (Mistral-7B-Instruct-v0.3's), when it ends otherwise (a tool result,
    an assistant turn to continue): the template dropped it without a word."""
    if (not chat_template or len(messages) < 2 or messages[0].get("role") != "system"
            or messages[-1].get("role") == "user" or not system_only_with_last_user(chat_template)):
        return messages
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        raise _bad(f"{param}: this model's chat template writes the system message into a user turn, and there is "
                   "none; add a user message", param)
    user = messages[last]
    text = "\n\n".join(t for t in (messages[0].get("content") or "", user.get("content") or "") if t)
    return [*messages[1:last], {**user, "content": text}, *messages[last + 1:]]


def _alternating(messages: list[dict[str, Any]], chat_template: str | None) -> list[dict[str, Any]]:
    """Consecutive user messages as one (texts joined by a blank line) for a template that refuses them in a row
    (Gemma's, Mistral's): OpenAI takes them, and tool results written as a user turn, or a failed response's input
    before the next turn's (/v1/responses), put them there; other templates get them as sent."""
    pairs = zip(messages, messages[1:], strict=False)
    if not chat_template or not any(a.get("role") == b.get("role") == "user" for a, b in pairs) \
            or not alternates(chat_template):
        return messages
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and m.get("role") == out[-1].get("role") == "user":
            out[-1] = {**out[-1], "content": "\n\n".join(t for t in (out[-1].get("content") or "",
                                                                      m.get("content") or "") if t)}
        else:
            out.append(m)
    return out


# Mistral's templates (7B v0.3, Nemo, Small) raise unless each tool call id is 9 characters
_NINE_CHAR_IDS = re.compile(r"id\s*\|\s*length\s*!=\s*9")


def _nine_chars(call_id: Any) -> Any:
    """A tool call id as Mistral's templates take it (9 letters or digits), the same id always to the same one:
    this server's ids (OpenAI's "call_" + 24) and most clients' were refused with "Tool call IDs should be
    alphanumeric strings with length 9!", so no tool result could be sent back (vLLM cuts them for Mistral)."""
    if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isascii() and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:9]


def tools_system_prompt(tools: Sequence[Tool]) -> str:
    """The Hermes / Qwen2.5 wording, for templates that carry no tool section of their own."""
    sigs = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{sigs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
            "\n</tool_call>")


def _with_tools_text(messages: list[dict[str, Any]], text: str, chat_template: str | None) -> list[dict[str, Any]]:
    """The tools' description in a system message; at the start of the first user turn for a template that
    refuses a system role or leaves it out (Gemma's), unless the client sent a system message of its own."""
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if (not chat_template or shows_system(chat_template) or first_user is None
            or messages[0].get("role") in ("system", "developer")):
        return _with_system(messages, text)
    m = dict(messages[first_user])
    m["content"] = f"{text}\n\n{m.get('content') or ''}".strip()
    return [*messages[:first_user], m, *messages[first_user + 1:]]


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def deepseek_tools_prompt(tools: Sequence[Tool], v3: bool) -> str:
    """The tools and DeepSeek's call markup (V3 / R1's, or V3.1's), for a template that writes past calls in it but
    describes no tools (R1-Distill's)."""
    sigs = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    call = ("function<｜tool▁sep｜>FUNCTION_NAME\n```json\n{ARGUMENTS}\n```" if v3
            else "FUNCTION_NAME<｜tool▁sep｜>{ARGUMENTS}")
    return ("You may call one or more functions to assist with the user query. The functions, as JSON signatures:\n"
            f"{sigs}\n\nTo call functions, write exactly:\n{_DS_CALLS}{_DS_CALL}{call}{_DS_CALL_END}{_DS_CALLS_END}\n"
            f"with one {_DS_CALL}...{_DS_CALL_END} per call, where FUNCTION_NAME is one of the functions above and "
            "ARGUMENTS is a JSON object of its arguments that follows its parameters schema.")


# a template that joins a call's arguments to text (``+ tool['function']['arguments'] +``, R1-Distill's and V3.1's
# own) wants them as the string the client sent; one that writes them with ``|tojson`` or iterates them, an object
_ARGUMENTS = r"""(?:\[\s*['"]arguments['"]\s*\]|\.arguments\b)"""
_JOINED_ARGUMENTS = re.compile(_ARGUMENTS + r"\s*\+|\+\s*[\w.]+(?:\[[^\]]*\])*" + _ARGUMENTS + r"\s*\}\}")


def _template_call(c: Any, as_text: bool = False) -> dict[str, Any]:
    f = dict(c.get("function") or {}) if isinstance(c, dict) else {}
    args = f.get("arguments")
    if as_text:  # the text as the client sent it (an object it sent written as JSON)
        if not isinstance(args, str):
            f["arguments"] = json.dumps({} if args is None else args, ensure_ascii=False)
    elif isinstance(args, str):
        try:
            f["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # the template gets the text as the client sent it
    return {"id": c.get("id"), "type": "function", "function": f}


# ---- response side ---------------------------------------------------------------------------------------
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_DS_CALLS, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_MARKERS = (_DS_CALLS, _DS_CALLS_END, _DS_CALL, _DS_CALL_END, _DS_SEP)
_DS_FENCE = "```json\n"
_DSML = "｜DSML｜"
_DSML_BLOCKS = {CallFormat.DEEPSEEK_V32: (f"<{_DSML}function_calls>", f"</{_DSML}function_calls>"),
                CallFormat.DEEPSEEK_V4: (f"<{_DSML}tool_calls>", f"</{_DSML}tool_calls>")}
_DSML_INVOKE, _DSML_INVOKE_END = f"<{_DSML}invoke", f"</{_DSML}invoke>"
_DSML_PARAM, _DSML_PARAM_END = f"<{_DSML}parameter", f"</{_DSML}parameter>"
_DSML_INVOKE_RE = re.compile(rf'<{_DSML}invoke\s+name="([^"]+)"\s*>')
_DSML_PARAM_RE = re.compile(rf'<{_DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>')
_MEMBER_KEY = re.compile(r'\s*"((?:[^"\\]|\\.)*)"\s*:\s*')


@dataclass
class _Scan:
    content: str  # text that is certainly content, in order
    calls: list[tuple[str | None, str, bool]]  # (name when known, arguments so far, complete)


class ToolCallStream:
    """Turns the model's text, fed as it streams, into content and tool-call deltas; ``parse`` does it whole.

    Every feed rescans the whole output (short) and emits only what can no longer change, so the
    concatenated deltas equal what the whole-text parse returns."""

    def __init__(self, fmt: CallFormat, tools: Sequence[Tool], named: str | None = None,
                 max_calls: int | None = None):
        """``max_calls``: calls past it are dropped (``parallel_tool_calls: false`` is 1: OpenAI's model then makes
        at most one call per answer)."""
        self.fmt = fmt
        self.names = {t.name for t in tools}
        self.named = named
        self.max_calls = max_calls
        self._buf = ""
        self._content_sent = 0
        self.calls: list[ToolCall] = []
        self._args_sent: list[int] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        return self._emit(final=False)

    def close(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest, once the output is complete. A call that turns out malformed at the end (its arguments cut
        off or not JSON) is no call: its text comes as content, and ``calls`` drops it — when streaming, its
        deltas already went out, and the finish reason (not ``tool_calls``) says it did not complete."""
        content, deltas = self._emit(final=True)
        valid = 0
        for (name, args, _done), sent in zip(self._scan(True).calls, self.calls, strict=False):
            if name != sent.name or args != sent.arguments:
                break
            valid += 1
        del self.calls[valid:], self._args_sent[valid:]
        return content, [d for d in deltas if d.index < valid]

    def _emit(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        s = self._scan(final)
        content = s.content[self._content_sent:]
        self._content_sent = len(s.content)
        deltas: list[ToolCallDelta] = []
        for i, (name, args, _done) in enumerate(s.calls):
            if name is None:
                break
            if i < len(self.calls) and (name != self.calls[i].name or not args.startswith(self.calls[i].arguments)):
                break  # a call sent so far turned out malformed, so the text no longer lines up with it: no more
            if i == len(self.calls):
                self.calls.append(ToolCall(name, ""))
                self._args_sent.append(0)
                deltas.append(ToolCallDelta(i, "", self.calls[i].id, name))
            new = args[self._args_sent[i]:]
            if new:
                self._args_sent[i] = len(args)
                self.calls[i].arguments = args
                deltas.append(ToolCallDelta(i, new))
        return content, deltas

    def _scan(self, final: bool) -> _Scan:
        if self.fmt == CallFormat.ARGUMENTS:
            return _Scan("", [(self.named, self._buf.lstrip(), final)])
        if self.fmt == CallFormat.MISTRAL:
            s = self._scan_mistral(final)
        elif self.fmt in (CallFormat.DEEPSEEK_V3, CallFormat.DEEPSEEK_V31) or self.fmt in _DSML_BLOCKS:
            s = self._scan_deepseek(final)
        else:
            s = self._scan_tagged(final) if self.fmt == CallFormat.TAGGED else self._scan_json(final)
        if self.max_calls is not None:
            del s.calls[self.max_calls:]
        return s

    def _scan_tagged(self, final: bool) -> _Scan:
        buf, pos, content, calls = self._buf, 0, [], []
        while True:
            j = buf.find(_OPEN, pos)
            if j < 0:
                tail = buf[pos:]
                if not final:  # a tag may be arriving: hold back what could be its start
                    tail = tail[:len(tail) - partial_suffix(tail, (_OPEN,))]
                content.append(tail)
                break
            content.append(buf[pos:j])
            k = _closing_tag(buf, j + len(_OPEN), final)
            body = buf[j + len(_OPEN):k if k >= 0 else len(buf)]
            if k < 0 and not final:  # the closing tag may be arriving: what could be its start is not the body's
                body = body[:len(body) - partial_suffix(body, (_CLOSE,))]
            found, ok, whole = _tagged_calls(body, complete=k >= 0 or final, names=self.names)
            if not ok:  # not a call after all (the tag in prose, written twice, an unknown function): the tag is
                content.append(_OPEN)  # text, and what follows it is scanned as any text is (a call may come next)
                pos = j + len(_OPEN)
                continue
            calls.extend(found)
            if not whole or k < 0:
                break
            pos = k + len(_CLOSE)
        return _Scan(_drop_blank("".join(content), bool(calls), final), calls)

    def _scan_mistral(self, final: bool) -> _Scan:
        """Mistral's calls after ``[TOOL_CALLS]``: a JSON array (v3 tokenizer) or ``name[ARGS]{...}`` each (v11+,
        a ``[CALL_ID]id`` after the name in v13), text before the marker the content. Without the marker (decoded
        away as a special token) an answer that is a bare array of calls is read as the JSON format reads it."""
        buf = self._buf
        j = buf.find(_MISTRAL_CALLS)
        if j < 0:
            held = 0 if final else partial_suffix(buf, (_MISTRAL_CALLS,))
            if buf.lstrip()[:1] in ("[", "{") and len(buf.lstrip()) > held:
                return self._scan_json(final)
            return _Scan(_drop_blank(buf[:len(buf) - held], False, final), [])
        body = buf[j + len(_MISTRAL_CALLS):]
        if body.lstrip()[:1] in ("[", "{"):  # v3: one JSON array of calls (or one call) after the marker
            found, ok, _whole = _tagged_calls(body, complete=final, names=self.names)
            calls = found if ok else []
        else:
            calls, ok = _named_calls(body, final, self.names)
        if not ok:  # not a call after all (cut off, malformed, an unknown function): the whole answer is content
            return _Scan(buf if final else _drop_blank(buf[:j], False, final), [])
        return _Scan(_drop_blank(buf[:j], bool(calls), final), calls)

    def _scan_deepseek(self, final: bool) -> _Scan:
        """DeepSeek's calls after ``<｜tool▁calls▁begin｜>``, text before it the content (vLLM's deepseek_v3 /
        deepseek_v31 parsers). A call that is cut off, malformed, or names no tool makes no calls: the whole answer
        is content, as vLLM gives it when its parse fails. Text after ``<｜tool▁calls▁end｜>`` (blank as a rule) is
        content too, after the text before the calls."""
        buf = self._buf
        start, end = _DSML_BLOCKS.get(self.fmt, (_DS_CALLS, _DS_CALLS_END))
        j = buf.find(start)
        if j < 0:
            held = 0 if final else partial_suffix(buf, (start,))
            return _Scan(_drop_blank(buf[:len(buf) - held], False, final), [])
        body = buf[j + len(start):]
        if self.fmt in _DSML_BLOCKS:
            calls, ok, after = _dsml_calls(body, final, self.names, end)
        else:
            calls, ok, after = _deepseek_calls(body, final, self.names, v3=self.fmt == CallFormat.DEEPSEEK_V3)
        if not ok:
            return _Scan(buf if final else _drop_blank(buf[:j], False, final), [])
        before = _drop_blank(buf[:j], bool(calls), final)
        return _Scan(before + after if after.strip() else before, calls)

    def _scan_json(self, final: bool) -> _Scan:
        buf = self._buf
        lead = len(buf) - len(buf.lstrip())
        rest, tag = buf[lead:], "<|python_tag|>"  # Llama 3.x's call marker, when special tokens are kept
        if rest.startswith(tag):
            lead += len(tag)
        elif rest and tag.startswith(rest) and not final:
            return _Scan("", [])
        p = _skip(buf, lead, " \t\r\n")
        if p >= len(buf):
            return _Scan(buf if final else "", [])
        if buf[p] not in "{[":
            return _Scan(buf, [])  # plain content
        array = buf[p] == "["
        if array:
            p += 1
        calls: list[tuple[str | None, str, bool]] = []
        while True:
            p = _skip(buf, p, " \t\r\n,;")
            if p >= len(buf) or buf[p] != "{":
                if not calls and (p < len(buf) or final):
                    return _Scan(buf, [])  # an array that holds no call ([1, 2], [], ["a"]): the answer is text
                if array and buf[p:p + 1] == "]":
                    p += 1
                break
            try:
                _, end = _DECODER.raw_decode(buf, p)
                body, complete = buf[p:end], True
            except json.JSONDecodeError:
                body, complete, end = buf[p:], final, len(buf)
            name, args, done, ok = _call_object(body, complete=complete, names=self.names)
            if not ok:
                if not calls and (complete or final):
                    return _Scan(buf, [])  # JSON that is not a call: the whole output is content
                break
            calls.append((name, args, done))
            if not done:
                return _Scan("", calls)  # still arriving
            p = end
        # What follows the calls (prose, or an object that is no call: cut off, malformed, an unknown function) is
        # content, as the other formats keep text after their calls; it was dropped without a word
        return _Scan(_drop_blank(buf[p:].lstrip(), True, final), calls)

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """After ``close``: the message content (None when it is only calls) and the calls."""
        content = self._scan(True).content
        return (content if content.strip() or not self.calls else None), list(self.calls)

    def finish(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The rest of the output, all at once: (content, calls) of the whole answer (``feed``, ``close``,
        ``result``). Read as final only: a non-final pass would send calls that the final text makes no calls, and
        the calls after one that ``close`` drops would go with it (a stream cannot take them back; a whole answer can)."""
        self._buf += text
        self.close()
        return self.result()


def parse(text: str, fmt: CallFormat, tools: Sequence[Tool], named: str | None = None,
          max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """Whole-output parse: (content, calls)."""
    return ToolCallStream(fmt, tools, named, max_calls).finish(text)


_STRING_OR_CLOSE = re.compile(r'"(?:[^"\\]|\\.)*(?:"|$)|' + re.escape(_CLOSE), re.S)


def _closing_tag(buf: str, i: int, final: bool) -> int:
    """Where the ``</tool_call>`` closing the call whose body starts at ``i`` is (-1: not yet). Arguments may hold
    the tag's text (code, a prompt about tool calls): one inside a JSON string of the body does not end the call
    (it made the whole call text), unless the output ends with that string never closed (malformed: as before)."""
    first = buf.find(_CLOSE, i)
    p = _skip(buf, i, " \t\r\n")
    if first < 0 or buf[p:p + 1] not in ("{", "["):
        return first
    try:
        _, end = _DECODER.raw_decode(buf, p)
    except json.JSONDecodeError:
        outside = next((m.start() for m in _STRING_OR_CLOSE.finditer(buf, p, first + len(_CLOSE))
                        if m.group() == _CLOSE), -1)
        return first if final or outside == first else -1  # in a string still arriving: wait for its end
    return first if first >= end else buf.find(_CLOSE, end)  # the JSON is whole: the tag after it


def _tagged_calls(body: str, complete: bool,
                  names: set[str]) -> tuple[list[tuple[str | None, str, bool]], bool, bool]:
    """The calls in one ``<tool_call>`` body: one call object (Hermes, Qwen2.5) or a JSON array of them (SmolLM2's
    ``<tool_call>[{...}, ...]</tool_call>``; ``[]`` is no call). Returns (calls, still valid, every call so far
    known whole — scanning may go on past this body)."""
    i = _skip(body, 0, " \t\r\n")
    if i >= len(body) or body[i] != "[":
        name, args, done, ok = _call_object(body, complete=complete, names=names)
        return ([(name, args, done)] if ok else []), ok, ok and name is not None and done
    calls: list[tuple[str | None, str, bool]] = []
    p = i + 1
    while True:
        p = _skip(body, p, " \t\r\n,")
        if p >= len(body):
            return calls, not complete, not complete  # the array goes on (or was cut off: not calls)
        if body[p] == "]":
            rest = body[p + 1:].strip()
            return calls, not rest, not rest
        if body[p] != "{":
            return [], False, False
        try:
            _, end = _DECODER.raw_decode(body, p)
            obj, whole = body[p:end], True
        except json.JSONDecodeError:
            obj, whole, end = body[p:], complete, len(body)
        name, args, done, ok = _call_object(obj, complete=whole, names=names)
        if not ok:
            return [], False, False
        calls.append((name, args, done))
        if not done or name is None:
            return calls, True, False
        p = end


def _named_calls(body: str, final: bool, names: set[str]) -> tuple[list[tuple[str | None, str, bool]], bool]:
    """Mistral v11+'s calls, ``name[ARGS]{...}`` each, the next after its own ``[TOOL_CALLS]``: (calls, still
    valid). A name that is no tool's, arguments that are not a JSON object, or other text between calls is no
    call."""
    calls: list[tuple[str | None, str, bool]] = []
    p = 0
    while True:
        a = body.find(_MISTRAL_ARGS, p)
        if a < 0:  # the name is still arriving
            if final:
                return [], False
            calls.append((None, "", False))
            return calls, True
        name = body[p:a].split(_MISTRAL_ID, 1)[0].strip()
        if name not in names:
            return [], False
        v = _skip(body, a + len(_MISTRAL_ARGS), " \t\r\n")
        if v >= len(body) or body[v] != "{":
            if final or v < len(body):
                return [], False
            calls.append((name, "", False))
            return calls, True
        try:
            _, end = _DECODER.raw_decode(body, v)
        except json.JSONDecodeError:
            if final:
                return [], False
            calls.append((name, body[v:], False))
            return calls, True
        calls.append((name, body[v:end], True))
        p = _skip(body, end, " \t\r\n")
        if p >= len(body):
            return calls, True
        if body.startswith(_MISTRAL_CALLS, p):
            p += len(_MISTRAL_CALLS)
        elif final or not _MISTRAL_CALLS.startswith(body[p:]):
            return [], False


def _deepseek_calls(body: str, final: bool, names: set[str],
                    v3: bool) -> tuple[list[tuple[str | None, str, bool]], bool, str]:
    """DeepSeek's calls after ``<｜tool▁calls▁begin｜>``: (calls, still valid, text after ``<｜tool▁calls▁end｜>``).
    Each is ``<｜tool▁call▁begin｜>`` + (V3) ``function<｜tool▁sep｜>NAME``, a newline and the arguments fenced as a
    json code block, or (V3.1)
    ``NAME<｜tool▁sep｜>{...}`` + ``<｜tool▁call▁end｜>``, whitespace between calls (R1's template writes a newline);
    the closing ``<｜tool▁calls▁end｜>`` may be missing at the end (R1-Distill's template leaves it out after a lone
    call, and a model may stop at the end of sentence right away). The arguments are a JSON object."""
    calls: list[tuple[str | None, str, bool]] = []

    p = 0
    while True:
        p = _skip(body, p, " \t\r\n")
        if body.startswith(_DS_CALLS_END, p):
            return calls, bool(calls), body[p + len(_DS_CALLS_END):]
        if p >= len(body):
            return calls, bool(calls) or not final, ""
        if not body.startswith(_DS_CALL, p):
            return (calls, True, "") if _arriving(final, body[p:], _DS_CALL, _DS_CALLS_END) else ([], False, "")
        p += len(_DS_CALL)
        s = body.find(_DS_SEP, p)
        if s < 0:  # the name (V3.1) or the type (V3) is still arriving
            if final or "\n" in body[p:]:
                return [], False, ""
            calls.append((None, "", False))
            return calls, True, ""
        head, p = body[p:s], s + len(_DS_SEP)
        if v3:
            if head.strip() != "function":
                return [], False, ""
            nl = body.find("\n", p)
            if nl < 0:  # the name is still arriving
                if final:
                    return [], False, ""
                calls.append((None, "", False))
                return calls, True, ""
            name, p = body[p:nl].strip(), nl + 1
            if not body.startswith(_DS_FENCE, p):
                if not _arriving(final, body[p:], _DS_FENCE):
                    return [], False, ""
                if name not in names:
                    return [], False, ""
                calls.append((name, "", False))
                return calls, True, ""
            p += len(_DS_FENCE)
        else:
            name = head.strip()
        if name not in names:
            return [], False, ""
        v = _skip(body, p, " \t\r\n")
        if v >= len(body) or body[v] != "{":
            if final or v < len(body):
                return [], False, ""
            calls.append((name, "", False))
            return calls, True, ""
        try:
            _, end = _DECODER.raw_decode(body, v)
        except json.JSONDecodeError:
            if final:
                return [], False, ""
            calls.append((name, body[v:], False))  # inside the object: all of it so far is the arguments'
            return calls, True, ""
        args, p = body[v:end], _skip(body, end, " \t\r\n")
        if v3:  # the closing fence
            if not body.startswith("```", p):
                if _arriving(final, body[p:], "```"):
                    calls.append((name, args, False))
                    return calls, True, ""
                return [], False, ""
            p = _skip(body, p + 3, " \t\r\n")
        if not body.startswith(_DS_CALL_END, p):
            if _arriving(final, body[p:], _DS_CALL_END):
                calls.append((name, args, False))
                return calls, True, ""
            return [], False, ""
        calls.append((name, args, True))
        p += len(_DS_CALL_END)


def _dsml_calls(body: str, final: bool, names: set[str],
                end: str) -> tuple[list[tuple[str | None, str, bool]], bool, str]:
    """V3.2's / V4's DSML calls after the block's opening tag: (calls, still valid, text after its closing tag ``end``).
    Whitespace between the tags (the encoders write newlines); each parameter's value is the text between its tags,
    a JSON string for ``string="true"``, else JSON itself; the arguments are the JSON object of the parameters in
    order, as the encoder's decode_dsml_to_arguments builds them. Streamed, they go out a parameter at a time. As
    vLLM's deepseek_v32 parser, a block that never closes makes no call, and so does a call to an unknown function,
    a parameter written twice or a non-string value that is no JSON: the whole answer is then content."""
    calls: list[tuple[str | None, str, bool]] = []

    def tag_arriving(rest: str) -> bool:  # an opening tag whose attributes are still arriving
        return not final and ">" not in rest

    p = 0
    while True:
        p = _skip(body, p, " \t\r\n")
        if body.startswith(end, p):
            return calls, bool(calls), body[p + len(end):]
        if p >= len(body):
            return calls, not final, ""
        if not body.startswith(_DSML_INVOKE, p):
            return (calls, True, "") if _arriving(final, body[p:], _DSML_INVOKE, end) else ([], False, "")
        m = _DSML_INVOKE_RE.match(body, p)
        if m is None:
            return (calls, True, "") if tag_arriving(body[p:]) else ([], False, "")
        name = m.group(1)
        if name not in names:
            return [], False, ""
        p, params, closed = m.end(), {}, False
        while True:
            p = _skip(body, p, " \t\r\n")
            if body.startswith(_DSML_INVOKE_END, p):
                p, closed = p + len(_DSML_INVOKE_END), True
                break
            if p >= len(body) or _arriving(final, body[p:], _DSML_PARAM, _DSML_INVOKE_END):
                break
            pm = _DSML_PARAM_RE.match(body, p) if body.startswith(_DSML_PARAM, p) else None
            if pm is None:
                if body.startswith(_DSML_PARAM, p) and tag_arriving(body[p:]):
                    break
                return [], False, ""
            key, string = pm.groups()
            e = body.find(_DSML_PARAM_END, pm.end())
            if e < 0:
                break  # the value is still arriving
            raw = body[pm.end():e]
            if key in params:
                return [], False, ""
            if string == "true":
                params[key] = raw
            else:
                try:  # NaN / Infinity are not JSON: arguments holding them would not parse for the client
                    params[key] = json.loads(raw, parse_constant=_no_constant)
                except (json.JSONDecodeError, ValueError):
                    return [], False, ""
            p = e + len(_DSML_PARAM_END)
        args = json.dumps(params, ensure_ascii=False)
        if not closed:
            if final:
                return [], False, ""
            calls.append((name, args[:-1], False))  # the object so far, its closing brace not yet known
            return calls, True, ""
        calls.append((name, args, True))


def _call_object(body: str, complete: bool, names: set[str]) -> tuple[str | None, str, bool, bool]:
    """(name, arguments text so far, arguments complete, still a valid call) of one call object's text."""
    i = _skip(body, 0, " \t\r\n")
    if i >= len(body):
        return None, "", False, not complete
    if body[i] != "{":
        return None, "", False, False
    members = _members(body, i)
    inner = members.get("function")
    if "name" not in members and inner is not None and body[inner:inner + 1] == "{":
        members = _members(body, inner)  # {"type": "function", "function": {...}}: a call as OpenAI's messages carry it
    name = None
    if "name" in members:
        try:
            value, _ = _DECODER.raw_decode(body, members["name"])
        except json.JSONDecodeError:
            if complete:
                return None, "", False, False
        else:
            if not isinstance(value, str) or value not in names:
                return None, "", False, False
            name = value
    v = members.get("arguments", members.get("parameters"))
    if v is None:
        if complete:  # a finished object with no arguments: a call with none, if it named a function
            return name, "{}" if name else "", True, name is not None
        return name, "", False, True
    try:
        value, end = _DECODER.raw_decode(body, v)
        return name, _arguments_text(value, body[v:end]), True, name is not None or not complete
    except json.JSONDecodeError:
        if complete:  # the object ended with arguments that are not JSON (cut off, or malformed): no call
            return None, "", False, False
        if body[v:v + 1] != "{":  # a string or other value: wait for all of it
            return name, "", False, True
        return name, body[v:], False, True


def _no_constant(name: str) -> Any:
    """json.loads' hook for NaN / Infinity / -Infinity, which Python accepts and JSON does not."""
    raise ValueError(f"{name} is not JSON")


def _arguments_text(value: Any, text: str) -> str:
    """The arguments as JSON text: as written, or the text a string holds when it holds JSON (a model writing
    ``"arguments": "{\\"city\\": ...}"``); a blank string or null is no arguments (``{}``, as OpenAI sends a call
    without any: clients that read the arguments into an object fail on ``null``), another string stays a JSON
    string."""
    if value is None:
        return "{}"
    if not isinstance(value, str):
        return text
    if not value.strip():
        return "{}"
    try:
        inner = json.loads(value)
    except json.JSONDecodeError:
        return text
    return "{}" if inner is None else value


def _members(body: str, i: int) -> dict[str, int]:
    """The keys of the JSON object opening at ``body[i]`` read so far, each with where its value starts: its own
    keys only, so a parameter called "name" (or an "arguments" key deeper down) is not taken for the call's."""
    found: dict[str, int] = {}
    p = i + 1
    while True:
        m = _MEMBER_KEY.match(body, p)
        if m is None:
            return found
        try:
            key = json.loads(f'"{m.group(1)}"')
        except json.JSONDecodeError:
            return found
        found.setdefault(key, m.end())
        try:
            _, end = _DECODER.raw_decode(body, m.end())
        except json.JSONDecodeError:
            return found  # the value is still arriving (or is not JSON)
        p = _skip(body, end, " \t\r\n")
        if body[p:p + 1] != ",":
            return found
        p += 1


def _arriving(final: bool, rest: str, *expected: str) -> bool:
    """Whether ``rest``, the output's unread tail, may still become one of ``expected`` (never once it is final)."""
    return not final and any(e.startswith(rest) for e in expected)


def _skip(s: str, i: int, chars: str) -> int:
    while i < len(s) and s[i] in chars:
        i += 1
    return i


def _drop_blank(content: str, has_calls: bool, final: bool) -> str:
    """Trailing whitespace waits (while streaming) to see whether a call follows; before calls it is dropped."""
    return content.rstrip() if has_calls or not final else content
