"""Function tools on ``/v1/responses``: ``tools`` in the Responses shape, ``tool_choice``, ``parallel_tool_calls``,
``function_call`` / ``function_call_output`` input items, ``function_call`` output items and their stream events.

``auto`` runs on the scripted tool-calling model of test_tool_calls_scripted (Qwen2.5-style ``<tool_call>`` tags and
Llama 3.x-style bare JSON, through each family's own template); ``required`` and a named function run on the same
bundle's random weights, where only the grammar makes the output a call. Every body and event is validated with the
``openai`` client's own types (``openai.types.responses``), raw off the wire."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.conftest import running_server
from tests.server.test_tool_calls_scripted import (
    LLAMA_TEMPLATE,
    QWEN_TEMPLATE,
    SCRIPTS,
    TURN,
    ScriptedModel,
    _bundle,
)
from tests.server.test_tool_calls_scripted import TOOLS as CHAT_TOOLS

TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]  # the Responses shape: no "function" wrapper
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def bundles(tiny_dense, tmp_path_factory):
    """family → the scripted test's bundle (built once) with that family's template."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            made[family] = _bundle(tiny_dense, tmp_path_factory.mktemp(family),
                                   QWEN_TEMPLATE if family == "qwen" else LLAMA_TEMPLATE)
        return made[family]

    return get


@pytest.fixture(scope="module", params=["qwen", "llama"])
def model(request, bundles):
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    family = request.param
    b = open_bundle(bundles(family))
    be = ScriptedModel(Tokenizer.from_bundle(b), SCRIPTS[family], TURN[family], num_slots=2, max_seq_len=2048)
    with running_server(LLMEngine(b, backend=be, num_slots=2)) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        srv.family, srv.backend = family, be
        yield srv


def _post(srv, **body) -> dict:
    """A non-streamed response, raw, validated as the openai client's ``Response``."""
    r = httpx.post(srv.url + "/v1/responses", json={"model": "scripted", "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def _stream(srv, **body) -> list[dict]:
    """A streamed response's events, raw, each validated as one of the openai client's stream events, numbered in
    order, its ``event:`` line naming its type."""
    events, kind = [], None
    with httpx.stream("POST", srv.url + "/v1/responses", timeout=60,
                      json={"model": "scripted", "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == kind
                EVENT.validate_python(data)
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _ask(script: str) -> str:
    return f"{script} What should we do?"


def _shape(output: list[dict]) -> list[tuple]:
    """The output items without their ids: (type, text) for a message, (type, name, arguments object) for a call."""
    out = []
    for item in output:
        if item["type"] == "message":
            out.append(("message", "".join(p["text"] for p in item["content"])))
        elif item["type"] == "function_call":
            assert item["id"].startswith("fc_") and item["call_id"].startswith("call_") and item["status"] == "completed"
            out.append(("function_call", item["name"], json.loads(item["arguments"])))
        else:
            out.append((item["type"],))
    return out


def _streamed_items(events: list[dict]) -> list[dict]:
    """The items as the events built them (added, deltas, done), checked against each other: what a client that
    reads the events rather than the final response gets."""
    items: dict[int, dict] = {}
    for e in events:
        t = e["type"]
        if t == "response.output_item.added":
            assert e["output_index"] not in items
            assert e["item"]["status"] == "in_progress"
            items[e["output_index"]] = {**e["item"], "text": "", "done": False}
            if e["item"]["type"] == "function_call":
                assert e["item"]["arguments"] == ""
        elif t == "response.output_text.delta":
            items[e["output_index"]]["text"] += e["delta"]
        elif t == "response.function_call_arguments.delta":
            item = items[e["output_index"]]
            assert item["type"] == "function_call" and e["item_id"] == item["id"] and not item["done"]
            item["arguments"] += e["delta"]
        elif t == "response.function_call_arguments.done":
            item = items[e["output_index"]]
            assert (e["item_id"], e["name"], e["arguments"]) == (item["id"], item["name"], item["arguments"])
        elif t == "response.output_item.done":
            item = items[e["output_index"]]
            assert e["item"]["id"] == item["id"] and not item["done"]
            if item["type"] == "function_call":
                assert (e["item"]["call_id"], e["item"]["name"], e["item"]["arguments"]) == (
                    item["call_id"], item["name"], item["arguments"])
            item["done"], item["final"] = True, e["item"]
    assert all(item["done"] for item in items.values()), "every item added is done before the response ends"
    # each item is done before the next is added, as OpenAI streams them
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == sorted(opened)
    return [items[i]["final"] for i in sorted(items)]


# ---- auto: the model's own calls ------------------------------------------------------------------------------
def test_a_text_then_a_call(model):
    body = _post(model, input=_ask("[one]"), tools=TOOLS)
    call = ("function_call", "get_weather", {"city": "Lyon", "unit": "C"})
    want = [("message", "Let me check the weather."), call] if model.family == "qwen" else [call]
    assert _shape(body["output"]) == want and body["status"] == "completed"
    assert body["tools"] == [{**t, "strict": None} for t in TOOLS] and body["tool_choice"] == "auto"
    assert body["parallel_tool_calls"] is True
    events = _stream(model, input=_ask("[one]"), tools=TOOLS)
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]["output"]
    assert _shape(final) == want and _streamed_items(events) == final
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 3  # the arguments stream as the model writes them
    # the client's own stream helper reads the events into the same response
    with model.client.responses.stream(model="scripted", input=_ask("[one]"), tools=TOOLS, temperature=0) as s:
        got = s.get_final_response()
    assert _shape([o.model_dump() for o in got.output]) == want


def test_parallel_calls(model):
    want = [("function_call", "stop_line", {"line": 4}), ("function_call", "get_weather", {"city": "Oslo", "unit": "F"})]
    body = _post(model, input=_ask("[two]"), tools=TOOLS)
    assert _shape(body["output"]) == want
    assert len({o["call_id"] for o in body["output"]} | {o["id"] for o in body["output"]}) == 4
    events = _stream(model, input=_ask("[two]"), tools=TOOLS)
    assert _shape(_streamed_items(events)) == want == _shape(events[-1]["response"]["output"])
    one = _post(model, input=_ask("[two]"), tools=TOOLS, parallel_tool_calls=False)
    assert _shape(one["output"]) == want[:1] and one["parallel_tool_calls"] is False
    assert _shape(_stream(model, input=_ask("[two]"), tools=TOOLS, parallel_tool_calls=False)[-1]["response"]
                  ["output"]) == want[:1]


def test_a_plain_answer_is_one_message(model):
    text = SCRIPTS[model.family]["[text]"]
    assert _shape(_post(model, input=_ask("[text]"), tools=TOOLS)["output"]) == [("message", text)]
    events = _stream(model, input=_ask("[text]"), tools=TOOLS)
    assert _shape(_streamed_items(events)) == [("message", text)] == _shape(events[-1]["response"]["output"])


@pytest.mark.parametrize("script", ["[cut]", "[unknown]"])
def test_a_malformed_or_unknown_call_is_text(model, script):
    """A call cut off or naming no listed function is not a call: the model's text is the message. Streamed, an item
    opened for a call that only turns out malformed at the end is done ``incomplete`` and left out of the response;
    its text comes after it (a message of its own when text came before the call: items do not interleave)."""
    text = SCRIPTS[model.family][script]
    assert _shape(_post(model, input=_ask(script), tools=TOOLS)["output"]) == [("message", text)]
    events = _stream(model, input=_ask(script), tools=TOOLS)
    final = events[-1]["response"]["output"]
    assert {i["type"] for i in final} == {"message"} and Response.model_validate(events[-1]["response"]).output_text == text
    streamed = _streamed_items(events)
    assert [i["status"] for i in streamed if i["type"] == "function_call"] == (["incomplete"] if script == "[cut]" else [])
    assert [i for i in streamed if i["type"] == "message"] == final


def test_tool_choice_none_lists_the_tools_and_parses_no_calls(model):
    """As vLLM (without --exclude-tools-when-tool-choice-none) and OpenAI: the model is told of the tools, and
    what it writes is the message's text, a call's markup included."""
    body = _post(model, input=_ask("[one]"), tools=TOOLS, tool_choice="none")
    assert _shape(body["output"]) == [("message", SCRIPTS[model.family]["[one]"])]
    assert body["tool_choice"] == "none"
    assert "get_weather" in model.backend.prompts[-1]


def test_the_tools_reach_the_models_template(model):
    _post(model, input=_ask("[text]"), tools=TOOLS, instructions="Be brief.")
    prompt = model.backend.prompts[-1]
    for t in CHAT_TOOLS:
        assert json.dumps(t, ensure_ascii=False) in prompt  # rendered by the model's own tool section, as chat's
    assert "Be brief." in prompt or model.family == "llama"


# ---- the loop: calls and their outputs handed back -------------------------------------------------------------
def _outputs(calls: list[dict], results: list[str]) -> list[dict]:
    return [{"type": "function_call_output", "call_id": c["call_id"], "output": r} for c, r in zip(calls, results,
                                                                                                    strict=True)]


def test_function_call_outputs_in_the_next_turn(model):
    """The agent loop: the response's output items and the calls' outputs sent back as input render as the
    assistant's tool calls and the tool results, as chat's ``tool_calls`` / ``tool`` messages do; the same turn
    continued with ``previous_response_id`` (only the outputs sent) renders the same prompt."""
    first = model.client.responses.create(model="scripted", input=_ask("[two]"), tools=TOOLS, temperature=0)
    calls = [o.model_dump(exclude_none=True) for o in first.output]
    assert [c["type"] for c in calls] == ["function_call", "function_call"]
    results = _outputs(calls, ["line 4 stopped", "Oslo: 50 F"])
    follow = {"type": "message", "role": "user", "content": "[after-result] And now?"}
    r = _post(model, input=[{"role": "user", "content": _ask("[two]")}, *calls, *results, follow], tools=TOOLS)
    assert _shape(r["output"]) == [("message", "Line 4 is stopped.")]
    prompt = model.backend.prompts[-1]
    assert "line 4 stopped" in prompt and "Oslo: 50 F" in prompt
    key = "arguments" if model.family == "qwen" else "parameters"
    assert json.dumps({"name": "stop_line", key: {"line": 4}}) in prompt  # the earlier call, as the model writes it
    # the chat path renders the same conversation the same way
    chat_calls = [{"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                  for c in calls]
    tool_messages = [{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]} for r in results]
    model.client.chat.completions.create(model="scripted", tools=CHAT_TOOLS, temperature=0, messages=[
        {"role": "user", "content": _ask("[two]")}, {"role": "assistant", "content": "", "tool_calls": chat_calls},
        *tool_messages, {"role": "user", "content": "[after-result] And now?"}])
    assert model.backend.prompts[-1] == prompt
    chained = _post(model, previous_response_id=first.id, input=[*results, follow], tools=TOOLS)
    assert _shape(chained["output"]) == [("message", "Line 4 is stopped.")] and model.backend.prompts[-1] == prompt
    # streamed, the kept response carries its calls too
    events = _stream(model, input=_ask("[two]"), tools=TOOLS)
    kept = events[-1]["response"]
    assert model.client.responses.retrieve(kept["id"]).model_dump()["output"][0]["call_id"] == kept["output"][0]["call_id"]
    _post(model, previous_response_id=kept["id"], input=[*_outputs(kept["output"], ["line 4 stopped", "Oslo: 50 F"]),
                                                         follow], tools=TOOLS)
    assert model.backend.prompts[-1] == prompt


def test_a_text_and_a_call_handed_back_are_one_assistant_turn(model):
    """OpenAI's output (a message, then its calls) handed back is one assistant turn with text and calls, as the
    chat message it stands for."""
    first = _post(model, input=_ask("[one]"), tools=TOOLS)
    results = _outputs([o for o in first["output"] if o["type"] == "function_call"], ["18 C"])
    _post(model, input=[{"role": "user", "content": _ask("[one]")}, *first["output"], *results,
                        {"role": "user", "content": "[after-result] And now?"}], tools=TOOLS)
    prompt = model.backend.prompts[-1]
    if model.family == "qwen":
        assert "<|im_start|>assistant\nLet me check the weather.<tool_call>" in prompt
    assert prompt.count("get_weather") == 2  # the tool's listing and the call, once


def test_langchain_on_the_responses_api(model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=model.url + "/v1", api_key="x", model="scripted", temperature=0, max_retries=0,
                     timeout=60, use_responses_api=True).bind_tools(CHAT_TOOLS)
    ai = llm.invoke([HumanMessage(_ask("[two]"))])
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("stop_line", {"line": 4}),
                                                                ("get_weather", {"city": "Oslo", "unit": "F"})]
    follow = llm.invoke([HumanMessage(_ask("[two]")), ai,
                         *(ToolMessage("done", tool_call_id=c["id"]) for c in ai.tool_calls),
                         HumanMessage("[after-result] And now?")])
    assert follow.text == "Line 4 is stopped."


# ---- what is refused ------------------------------------------------------------------------------------------
_CALL = {"type": "function_call", "call_id": "call_1", "name": "stop_line", "arguments": "{\"line\": 4}"}


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}]), "tools[0].type"),
    (dict(tools=[CHAT_TOOLS[0]]), "tools[0].name"),
    (dict(tools=[None]), "tools[0]"),  # chat's shape, {"function": {...}}, sent here
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools[1].name"),
    (dict(tools=[{"type": "function", "name": "bad name"}]), "tools[0].name"),
    (dict(tools=[{"type": "function", "name": "f", "parameters": [1]}]), "tools[0].parameters"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "stop_line"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "web_search_preview"}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),

    (dict(tools=TOOLS, tool_choice="required",
          text={"format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}}}), "tool_choice"),
    (dict(input=[{"role": "user", "content": "hi"},
                 {"type": "function_call_output", "call_id": "call_9", "output": "x"}]), "input[1].call_id"),
    (dict(input=[{"role": "user", "content": "hi"}, {**_CALL, "name": None}]), "input[1].name"),
    (dict(input=[{"role": "user", "content": "hi"}, {**_CALL, "arguments": {"line": 4}}]), "input[1].arguments"),
    (dict(input=[{"role": "user", "content": "hi"}, {**_CALL, "call_id": 5}]), "input[1].call_id"),
    (dict(input=[{"role": "user", "content": "hi"}, _CALL,
                 {"type": "function_call_output", "call_id": "call_1", "output": None}]), "input[2].output"),
    (dict(input=[{"role": "user", "content": "hi"}, _CALL,
                 {"type": "function_call_output", "call_id": "call_1",
                  "output": [{"type": "input_image", "image_url": "x"}]}]), "input[2].output[0].type"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(model, kw, param):
    kw = {"input": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        model.client.responses.create(model="scripted", max_output_tokens=4, **kw)
    assert e.value.body["param"] == param and "\n" not in e.value.body["message"]


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{**TOOLS[0], "description": "a\ud800b"}]), "tools.0.description"),
    (dict(input=[{"role": "user", "content": "hi"}, {**_CALL, "arguments": "a\ud800b"}]), "input.1.arguments"),
])
def test_a_lone_surrogate_in_a_tool_or_a_call_is_a_400_naming_it(model, kw, param):
    raw = json.dumps({"model": "scripted", "input": "hi", "max_output_tokens": 2, **kw})  # \ud800 escaped
    r = httpx.post(model.url + "/v1/responses", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_utf8", param)


def test_a_function_call_output_with_text_parts(model):
    """``output`` as a list of input_text parts (OpenAI's other form) is their text."""
    parts = [{"type": "input_text", "text": "line 4"}, {"type": "input_text", "text": "stopped"}]
    _post(model, input=[{"role": "user", "content": _ask("[two]")}, _CALL,
                        {"type": "function_call_output", "call_id": "call_1", "output": parts},
                        {"role": "user", "content": "[after-result] And now?"}], tools=TOOLS)
    assert "line 4\nstopped" in model.backend.prompts[-1]


# ---- required and named: the grammar makes the output calls ---------------------------------------------------
STRICT = [
    {"type": "function", "name": "stop_line", "description": "Stop a line", "strict": True, "parameters": {
        "type": "object", "properties": {"line": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["line"], "additionalProperties": False}},
    {"type": "function", "name": "get_weather", "description": "Weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Lyon", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}},
]


@pytest.fixture(scope="module")
def random_model(bundles):
    """The Qwen-style bundle's own random weights: whatever they write, only the grammar makes it a call."""
    with running_server(bundles("qwen"), num_slots=2, threads=1) as srv:
        yield srv


@pytest.mark.parametrize("choice", ["required", "required-single", "get_weather"])
@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_make_calls(random_model, choice, stream):
    kw = dict(input="Stop line 3.", tools=STRICT, max_output_tokens=300, parallel_tool_calls=choice != "required-single",
              tool_choice="required" if choice.startswith("required") else {"type": "function", "name": choice})
    if stream:
        events = _stream(random_model, **kw)
        body = events[-1]["response"]
        assert _streamed_items(events) == body["output"]
    else:
        body = _post(random_model, **kw)
    assert body["status"] == "completed" and body["output"]
    assert body["tool_choice"] == kw["tool_choice"]
    schemas = {t["name"]: t["parameters"] for t in STRICT}
    for name, *rest in (shape[1:] for shape in _shape(body["output"])):
        assert name in schemas and set(rest[0]) == set(schemas[name]["required"])
        assert name == choice or choice.startswith("required")
    if choice == "required-single" or choice == "get_weather":
        assert len(body["output"]) == 1


def test_pydantic_tools_through_responses_parse(random_model):
    """``openai.pydantic_responses_function_tool`` (strict, nested models under ``$defs``) with ``responses.parse``:
    the client parses each call's arguments into the model, so they must validate against it."""
    from typing import Literal

    from pydantic import BaseModel

    class Place(BaseModel):
        city: Literal["Lyon", "Oslo"]

    class GetWeather(BaseModel):
        place: Place
        unit: Literal["C", "F"]

    client = openai.OpenAI(base_url=random_model.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for choice in ("required", {"type": "function", "name": "GetWeather"}):
        r = client.responses.parse(model="scripted", input="Weather?", temperature=0, max_output_tokens=200,
                                   tools=[openai.pydantic_responses_function_tool(GetWeather)], tool_choice=choice)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and all(isinstance(c.parsed_arguments, GetWeather) for c in calls)
