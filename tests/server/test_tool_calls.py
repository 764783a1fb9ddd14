"""Tool calling without a model: tools / tool_choice checks, history rendering, the model formats parsed
whole and streamed (the streamed deltas add up to the whole parse), and required / named grammars whose
every output parses into calls that validate against the tool schema."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lineside.runtime.sampling import Sampler, SamplingParams
from lineside.runtime.structured import GrammarCompiler
from lineside.server.errors import APIError
from lineside.server.tool_calls import (
    CallFormat,
    ToolCallStream,
    ToolChoiceKind,
    call_format,
    parse,
    parse_tool_choice,
    parse_tools,
    template_messages,
    tool_constraint,
)
from tests.tiny_tokenizer import write_byte_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
STOP = {"type": "function", "function": {
    "name": "stop_line", "parameters": {"type": "object", "properties": {
        "station": {"type": "integer", "minimum": 1, "maximum": 40}}, "required": ["station"],
        "additionalProperties": False}}}
TOOLS = parse_tools([WEATHER, STOP])


def _stream(text: str, fmt: CallFormat, named: str | None = None, step: int = 1):
    s = ToolCallStream(fmt, TOOLS, named)
    content, calls = "", {}
    for i in range(0, len(text), step):
        c, ds = s.feed(text[i:i + step])
        content += c
        for d in ds:
            calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            assert d.id is None or calls[d.index]["id"] == d.id
            calls[d.index]["arguments"] += d.arguments
    c, ds = s.close()
    content += c
    for d in ds:
        calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
        calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)], s


QWEN = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "stop_line", "arguments": {"station": 7}}\n</tool_call>')
MISTRAL = '[TOOL_CALLS]stop_line[ARGS]{"station": 12}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "F"}'
DS_V3 = ('Let me check.\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
         '{"city": "Lyon", "unit": "C"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>stop_line\n'
         '```json\n{\n  "station": 7\n}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DS_V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "unit": "F"}'
          '<｜tool▁call▁end｜><｜tool▁call▁begin｜>stop_line<｜tool▁sep｜>{"station": 12}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
# DeepSeek-V4's DSML calls as its encoder (encoding_dsv4.py) writes an assistant turn's: content, a blank line, the
# block; V3.2's (encoding_dsv32.py) the same in a function_calls block
DS_V4 = ('Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="city" string="true">Lyon</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="unit" string="true">C</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
         '<｜DSML｜invoke name="stop_line">\n<｜DSML｜parameter name="station" string="false">7</｜DSML｜parameter>\n'
         '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
DS_V32 = DS_V4.replace("tool_calls>", "function_calls>")
LLAMA = '{"name": "stop_line", "parameters": {"station": 12}}; {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}'


@pytest.mark.parametrize("text, fmt, content, calls", [
    (QWEN, CallFormat.TAGGED, "I will check.",
     [("get_weather", '{"city": "Lyon", "unit": "C"}'), ("stop_line", '{"station": 7}')]),
    (LLAMA, CallFormat.JSON, None, [("stop_line", '{"station": 12}'), ("get_weather", '{"city": "Oslo", "unit": "F"}')]),
    ('<|python_tag|>{"name": "stop_line", "parameters": {"station": 3}}', CallFormat.JSON, None,
     [("stop_line", '{"station": 3}')]),
    ('[{"name": "stop_line", "arguments": {"station": 1}}]', CallFormat.JSON, None, [("stop_line", '{"station": 1}')]),
    ("No call needed: it is sunny.", CallFormat.TAGGED, "No call needed: it is sunny.", []),
    ('{"answer": 42}', CallFormat.JSON, '{"answer": 42}', []),  # JSON that is not a call stays content
    ('<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>', CallFormat.TAGGED,  # unknown function
     '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>', []),
    ('a < b <tool_ and <tool_call', CallFormat.TAGGED, "a < b <tool_ and <tool_call", []),
    # SmolLM2's trained format: a JSON array of calls inside one pair of tags; [] is no call
    ('Sure.\n<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}},\n'
     '{"name": "stop_line", "arguments": {"station": 7}}\n]</tool_call>', CallFormat.TAGGED, "Sure.",
     [("get_weather", '{"city": "Lyon", "unit": "C"}'), ("stop_line", '{"station": 7}')]),
    ('<tool_call>[]</tool_call>', CallFormat.TAGGED, "", []),
    ('<tool_call>[{"name": "launch_rocket", "arguments": {}}]</tool_call>', CallFormat.TAGGED,
     '<tool_call>[{"name": "launch_rocket", "arguments": {}}]</tool_call>', []),
    ('<tool_call>[{"name": "stop_line", "arguments": {"station": 1}}]</tool_call> then <tool_call>'
     '{"name": "stop_line", "arguments": {"station": 2}}</tool_call>', CallFormat.TAGGED, " then",
     [("stop_line", '{"station": 1}'), ("stop_line", '{"station": 2}')]),
    # Mistral: v3's JSON array after [TOOL_CALLS], v11's name[ARGS]{...} per marker (v13: a [CALL_ID] after the name)
    ('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}, '
     '{"name": "stop_line", "arguments": {"station": 7}}]', CallFormat.MISTRAL, "Checking.",
     [("get_weather", '{"city": "Lyon", "unit": "C"}'), ("stop_line", '{"station": 7}')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "unit": "C"}[TOOL_CALLS]stop_line[ARGS]{"station": 7}',
     CallFormat.MISTRAL, None, [("get_weather", '{"city": "Lyon", "unit": "C"}'), ("stop_line", '{"station": 7}')]),
    ('[TOOL_CALLS]stop_line[CALL_ID]a1b2c3d4e[ARGS]{"station": 2}', CallFormat.MISTRAL, None,
     [("stop_line", '{"station": 2}')]),
    (' [{"name": "stop_line", "arguments": {"station": 1}}]', CallFormat.MISTRAL, None,  # the marker decoded away
     [("stop_line", '{"station": 1}')]),
    ('[TOOL_CALLS]launch_rocket[ARGS]{}', CallFormat.MISTRAL, "[TOOL_CALLS]launch_rocket[ARGS]{}", []),
    ("Use [x] and [TOOL", CallFormat.MISTRAL, "Use [x] and [TOOL", []),
    ("It is sunny. ", CallFormat.MISTRAL, "It is sunny. ", []),
    # DeepSeek V3 / R1: function<｜tool▁sep｜>NAME, a fenced json block; calls apart by a newline (R1's template)
    (DS_V3, CallFormat.DEEPSEEK_V3, "Let me check.",
     [("get_weather", '{"city": "Lyon", "unit": "C"}'), ("stop_line", '{\n  "station": 7\n}')]),
    # R1-Distill's template leaves <｜tool▁calls▁end｜> out after a lone call
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>stop_line\n```json\n{"station": 2}\n```'
     '<｜tool▁call▁end｜>', CallFormat.DEEPSEEK_V3, None, [("stop_line", '{"station": 2}')]),
    (DS_V31, CallFormat.DEEPSEEK_V31, None,
     [("get_weather", '{"city": "Oslo", "unit": "F"}'), ("stop_line", '{"station": 12}')]),
    # text after the calls' end is content, after the text before them
    ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>stop_line<｜tool▁sep｜>{"station": 1}<｜tool▁call▁end｜>'
     '<｜tool▁calls▁end｜> Done.', CallFormat.DEEPSEEK_V31, "Sure. Done.", [("stop_line", '{"station": 1}')]),
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>launch_rocket<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     CallFormat.DEEPSEEK_V31,  # an unknown function: content
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>launch_rocket<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', []),
    ("a <｜tool▁ b", CallFormat.DEEPSEEK_V3, "a <｜tool▁ b", []),
    # V3.2 / V4 DSML: string="true" values as text (JSON-escaped), string="false" as JSON; no parameter is {}
    (DS_V4, CallFormat.DEEPSEEK_V4, "Let me check.",
     [("get_weather", '{"city": "Lyon", "unit": "C"}'), ("stop_line", '{"station": 7}')]),
    (DS_V32, CallFormat.DEEPSEEK_V32, "Let me check.",
     [("get_weather", '{"city": "Lyon", "unit": "C"}'), ("stop_line", '{"station": 7}')]),
    ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
     'Saint "Malo"\n<b></｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="stop_line">\n</｜DSML｜invoke>\n'
     '</｜DSML｜tool_calls>', CallFormat.DEEPSEEK_V4, None,
     [("get_weather", '{"city": "Saint \\"Malo\\"\\n<b>"}'), ("stop_line", "{}")]),
    ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="stop_line">\n<｜DSML｜parameter name="station" string="false">'
     '[1, {"a": null}]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nDone.', CallFormat.DEEPSEEK_V4,
     "\n\nDone.", [("stop_line", '{"station": [1, {"a": null}]}')]),
    ("a <｜DSML｜tool b", CallFormat.DEEPSEEK_V4, "a <｜DSML｜tool b", []),
])
def test_formats_parse_whole_and_streamed_alike(text, fmt, content, calls):
    got_content, got_calls = parse(text, fmt, TOOLS)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for step in (1, 3, 7):
        s_content, s_calls, s = _stream(text, fmt, step=step)
        assert s_content == (content or "")
        assert [(c["name"], c["arguments"]) for c in s_calls] == calls
        assert [c["id"] for c in s_calls] == [c.id for c in s.calls]


@pytest.mark.parametrize("text, fmt", [(QWEN, CallFormat.TAGGED), (LLAMA, CallFormat.JSON), (MISTRAL, CallFormat.MISTRAL),
                                       (DS_V3, CallFormat.DEEPSEEK_V3), (DS_V31, CallFormat.DEEPSEEK_V31),
                                       (DS_V4, CallFormat.DEEPSEEK_V4), (DS_V32, CallFormat.DEEPSEEK_V32)])
def test_one_call_at_most_without_parallel_calls(text, fmt):
    """``parallel_tool_calls: false`` (max_calls 1): the first call only, whole and streamed alike."""
    content, calls = parse(text, fmt, TOOLS, max_calls=1)
    full = parse(text, fmt, TOOLS)[1]
    assert [(c.name, c.arguments) for c in calls] == [(full[0].name, full[0].arguments)]
    for step in (1, 5):
        s = ToolCallStream(fmt, TOOLS, max_calls=1)
        deltas = [d for i in range(0, len(text), step) for d in s.feed(text[i:i + step])[1]] + s.close()[1]
        assert {d.index for d in deltas} == {0} and [(c.name, c.arguments) for c in s.calls] == \
            [(full[0].name, full[0].arguments)]


def test_named_format_streams_arguments_from_the_first_token():
    s = ToolCallStream(CallFormat.ARGUMENTS, TOOLS, named="stop_line")
    c, ds = s.feed('{"sta')
    assert c == "" and ds[0].name == "stop_line" and ds[0].id.startswith("call_") and ds[1].arguments == '{"sta'
    s.feed('tion": 4}')
    s.close()
    assert s.result() == (None, s.calls) and s.calls[0].arguments == '{"station": 4}'


@pytest.mark.parametrize("tools, param, words", [
    ([WEATHER, WEATHER], "tools[1].function.name", "already the name of tools[0]"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name", "1-64 letters"),
    ([{"type": "function", "function": {"name": "f\n"}}], "tools[0].function.name", "1-64 letters"),  # "$" passes \n
    ([{"type": "retrieval"}], "tools[0]", "must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters", "schema"),
])
def test_bad_tools_are_400_naming_the_entry(tools, param, words):
    with pytest.raises(APIError) as e:
        parse_tools(tools)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_tool_choice():
    assert parse_tool_choice(None, TOOLS).kind == ToolChoiceKind.AUTO
    assert parse_tool_choice(None, []).kind == ToolChoiceKind.NONE
    named = parse_tool_choice({"type": "function", "function": {"name": "stop_line"}}, TOOLS)
    assert (named.kind, named.name) == (ToolChoiceKind.NAMED, "stop_line")
    for bad, param in [("sometimes", "tool_choice"), ({"type": "function", "function": {"name": "nope"}},
                                                      "tool_choice")]:
        with pytest.raises(APIError) as e:
            parse_tool_choice(bad, TOOLS)
        assert e.value.param == param
    with pytest.raises(APIError):
        parse_tool_choice("required", [])


def test_history_rendering_with_and_without_template_support():
    msgs = [{"role": "user", "content": "Weather in Lyon?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Lyon", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    auto = parse_tool_choice("auto", TOOLS)
    qwen_like = "{% for t in tools %}{{ t.function.name }}{% endfor %}<tool_call>"
    out, tools = template_messages(msgs, TOOLS, qwen_like, auto)
    assert tools[0]["function"]["name"] == "get_weather"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Lyon", "unit": "C"}  # objects, as HF wants
    assert out[2]["role"] == "tool"
    plain, none = template_messages(msgs, TOOLS, "{{ messages }}", auto)
    assert none is None and plain[0]["role"] == "system" and "<tools>" in plain[0]["content"]
    assert "<tool_call>" in plain[2]["content"] and plain[3] == {
        "role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    assert call_format(auto, "{{ messages }}") == CallFormat.TAGGED
    assert call_format(auto, "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS] [") == CallFormat.MISTRAL
    assert call_format(auto, "{{ messages }}", "mistral") == CallFormat.MISTRAL
    assert call_format(auto, "{% if tools %}{{ tools | tojson }}{% endif %}") == CallFormat.JSON
    # --tool-call-parser: what the template cannot say
    assert call_format(auto, "{% if tools %}{{ tools | tojson }}{% endif %}", "hermes") == CallFormat.TAGGED
    assert call_format(auto, "<tool_call>{% if tools %}{% endif %}", "llama3_json") == CallFormat.JSON
    assert call_format(parse_tool_choice("required", TOOLS), None, "hermes") == CallFormat.JSON  # the grammar's
    # DeepSeek's markup in the template: V3 / R1's fenced json, else V3.1's; or named by --tool-call-parser
    r1_like = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + '```json'}}"
    assert call_format(auto, r1_like) == CallFormat.DEEPSEEK_V3
    assert call_format(auto, "{% if tools %}{% endif %}{{'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>'}}") == \
        CallFormat.DEEPSEEK_V31
    assert call_format(auto, "{{ messages }}", "deepseek_v3") == CallFormat.DEEPSEEK_V3
    assert call_format(auto, r1_like, "deepseek_v31") == CallFormat.DEEPSEEK_V31


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    from lineside.runtime.tokenizer import Tokenizer

    tok = Tokenizer(d, {"bos_token_id": 1, "eos_token_ids": [2]})
    return tok, GrammarCompiler.for_tokenizer(tok, 300, [2])


def _random_walk(tiny, tools, tc, parallel: bool, seed: int):
    """Sample random logits under the tool grammar (closing characters favoured so it ends) and parse the text."""
    tok, comp = tiny
    m = comp.matcher(tool_constraint(tools, tc, parallel))
    rng, s, out = np.random.default_rng(seed), Sampler(SamplingParams(temperature=1.0, seed=seed)), []
    while not m.finished and len(out) < 600:
        logits = rng.standard_normal(300).astype(np.float32) * 3
        for ch in '"]}':
            logits[tok.encode(ch, add_special=False)[0]] += 5.0
        t = s.step(logits, allowed=m.allowed()).token
        assert m.accept(t)
        if t == 2:
            break
        out.append(t)
    return parse(tok.decode(out), call_format(tc, None), tools, named=tc.name)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("choice", ["required", "required-single", "stop_line", "get_weather"])
def test_required_and_named_outputs_always_parse(tiny, seed, choice):
    """Random logits under the tool grammar: the output always parses into calls of known tools whose
    arguments validate against the tool's schema."""
    from pydantic import TypeAdapter

    parallel = choice != "required-single"
    tc = parse_tool_choice("required" if choice.startswith("required") else
                           {"type": "function", "function": {"name": choice}}, TOOLS)
    content, calls = _random_walk(tiny, TOOLS, tc, parallel, seed)
    assert content is None and calls and (parallel or len(calls) == 1)
    for c in calls:
        args = json.loads(c.arguments)
        if c.name == "stop_line":
            assert set(args) == {"station"} and 1 <= args["station"] <= 40
        else:
            assert set(args) == {"city", "unit"} and args["unit"] in "CF" and len(args["city"]) <= 16
        TypeAdapter(dict).validate_python(args)


# pydantic's model_json_schema() (what openai.pydantic_function_tool sends) puts nested models in $defs and refers
# to them by "#/$defs/..." from the root of the parameters; older generators use "definitions"
LOCATE = {"type": "function", "function": {"name": "locate", "parameters": {
    "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}, "enum": {"$ref": "#/$defs/Unit"}},
    "required": ["place"],
    "additionalProperties": False, "$defs": {"Place": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
        "additionalProperties": False}, "Unit": {"type": "string", "enum": ["C", "F"]}}}}}
STATION = {"type": "function", "function": {"name": "station", "parameters": {
    "type": "object", "properties": {"id": {"$ref": "#/definitions/Id"}}, "required": ["id"],
    "additionalProperties": False, "definitions": {"Id": {"type": "integer", "minimum": 1, "maximum": 9}}}}}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("choice", ["required", "required-single", "locate"])
def test_tool_schemas_with_local_refs_constrain_required_and_named(tiny, seed, choice):
    """tool_choice required wraps every tool's parameters in one array schema, which moved them off the root: their
    "#/$defs/..." refs pointed at nothing and the request was a 400 "Pointer '/$defs/Place' does not exist" for
    any pydantic-made tool. The refs now follow the parameters to where the wrapper puts them."""
    tools = parse_tools([LOCATE, STATION])
    parallel = choice != "required-single"
    tc = parse_tool_choice("required" if choice.startswith("required") else
                           {"type": "function", "function": {"name": choice}}, tools)
    content, calls = _random_walk(tiny, tools, tc, parallel, seed)
    assert content is None and calls
    for c in calls:
        args = json.loads(c.arguments)
        if c.name == "locate":
            assert args["place"] == {"unit": args["place"]["unit"]} and args["place"]["unit"] in "CF"
            assert set(args) <= {"place", "enum"} and args.get("enum", "C") in "CF"  # a property named "enum"
        else:
            assert set(args) == {"id"} and 1 <= args["id"] <= 9
    assert tools[0].parameters == LOCATE["function"]["parameters"]  # the request's schema is left as it was


@pytest.mark.parametrize("text", ["[1, 2, 3]", "[]", '["Lyon", "Oslo"]', "[[1], {}]", "  [\n  true\n]"])
def test_a_json_array_holding_no_call_is_content(text):
    """Llama 3.x's format with tools offered, and the model answers a JSON array that holds no call object (a list
    the user asked for): it is the answer's content, whole and streamed alike. It was dropped: content "" and no
    calls, the answer lost."""
    assert parse(text, CallFormat.JSON, TOOLS) == (text, [])
    for step in (1, 2, 5):
        content, calls, _ = _stream(text, CallFormat.JSON, step=step)
        assert (content, calls) == (text, [])


GREET = parse_tools([{"type": "function", "function": {"name": "greet", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}, STOP])


@pytest.mark.parametrize("text, fmt, calls", [
    # the arguments first, with a parameter called "name": the call is greet's, not a call of whatever it holds
    ('<tool_call>{"arguments": {"name": "Bob"}, "name": "greet"}</tool_call>', CallFormat.TAGGED,
     [("greet", '{"name": "Bob"}')]),
    ('<tool_call>{"arguments": {"name": "stop_line"}, "name": "greet"}</tool_call>', CallFormat.TAGGED,
     [("greet", '{"name": "stop_line"}')]),
    ('{"parameters": {"name": "stop_line"}, "name": "greet"}', CallFormat.JSON, [("greet", '{"name": "stop_line"}')]),
    # an "arguments" key inside another member's value is not the call's arguments
    ('<tool_call>{"name": "greet", "meta": {"arguments": 5}, "arguments": {"name": "Al"}}</tool_call>',
     CallFormat.TAGGED, [("greet", '{"name": "Al"}')]),
])
def test_only_the_call_objects_own_keys_name_the_function(text, fmt, calls):
    """A key "name" inside the arguments was taken for the function's name (the first "name" anywhere in the
    object): a call listing its arguments first was lost as text, or named the wrong function."""
    content, got = parse(text, fmt, GREET)
    assert (content, [(c.name, c.arguments) for c in got]) == (None, calls)
    for step in (1, 4):
        s = ToolCallStream(fmt, GREET)
        deltas = [d for i in range(0, len(text), step) for d in s.feed(text[i:i + step])[1]] + s.close()[1]
        assert [(d.name, d.arguments) for d in deltas if d.name] == [(n, "") for n, _ in calls]
        assert "".join(d.arguments for d in deltas) == "".join(a for _, a in calls)


@pytest.mark.parametrize("text, fmt, arguments", [
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lyon\\"}"}</tool_call>', CallFormat.TAGGED,
     '{"city": "Lyon"}'),  # JSON text in a string: the text
    ('<tool_call>{"name": "get_weather", "arguments": "Lyon"}</tool_call>', CallFormat.TAGGED, '"Lyon"'),
    ('{"name": "get_weather", "parameters": "{\\"city\\": \\"Ly"}', CallFormat.JSON, '"{\\"city\\": \\"Ly"'),
    ('{"name": "get_weather", "parameters": ""}', CallFormat.JSON, '{}'),  # none, as history's "" is read
])
def test_arguments_given_as_a_string_are_always_json(text, fmt, arguments):
    """A string that holds JSON is the arguments' text; one that does not (plain words, JSON cut short) was passed
    on as it was, so ``json.loads(function.arguments)`` failed in the client: it stays a JSON string."""
    _, calls = parse(text, fmt, TOOLS)
    assert [c.arguments for c in calls] == [arguments]
    json.loads(calls[0].arguments)
    for step in (1, 3):
        content, streamed, _ = _stream(text, fmt, step=step)
        assert (content, [c["arguments"] for c in streamed]) == ("", [arguments])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("choice", ["required", "anything"])
@pytest.mark.parametrize("parameters", [{}, {"properties": {"path": {"type": "string"}}},
                                        {"$schema": "http://json-schema.org/draft-07/schema#"}])
def test_arguments_are_an_object_when_the_schema_gives_no_type(tiny, seed, choice, parameters):
    """Function arguments are a JSON object (OpenAI's contract; clients call ``fn(**json.loads(arguments))``). A
    tool whose parameters schema names no type ({} for "any arguments", properties without "type": "object", a
    bare $schema as agent SDKs send for tools without parameters) let the grammar write a string or a number."""
    tools = parse_tools([{"type": "function", "function": {"name": "anything", "parameters": parameters}}])
    tc = parse_tool_choice("required" if choice == "required" else
                           {"type": "function", "function": {"name": choice}}, tools)
    _, calls = _random_walk(tiny, tools, tc, True, seed)
    assert calls and all(isinstance(json.loads(c.arguments), dict) for c in calls)
    assert tools[0].parameters == parameters  # the request's schema (what the template shows) is left as it was


@pytest.mark.parametrize("text, content, calls", [
    ('Write the <tool_call> tag, like this:\n<tool_call>{"name": "stop_line", "arguments": {"station": 2}}</tool_call>',
     "Write the <tool_call> tag, like this:", [("stop_line", '{"station": 2}')]),
    ('<tool_call>\n<tool_call>\n{"name": "stop_line", "arguments": {"station": 3}}\n</tool_call>', "<tool_call>",
     [("stop_line", '{"station": 3}')]),  # a stuttered opening tag
])
def test_a_tag_that_opens_no_call_does_not_swallow_the_next_call(text, content, calls):
    """A ``<tool_call>`` that is not followed by a call (the tag named in prose, or written twice) made everything up
    to the next ``</tool_call>`` text, the real call after it included."""
    got_content, got = parse(text, CallFormat.TAGGED, TOOLS)
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)
    for step in (1, 3):
        s_content, s_calls, _ = _stream(text, CallFormat.TAGGED, step=step)
        assert (s_content, [(c["name"], c["arguments"]) for c in s_calls]) == (content, calls)


def test_text_after_a_tag_that_opens_no_call_streams_as_it_comes():
    """The tag named in prose held back the rest of the answer until its very end (waiting for a ``</tool_call>``
    that never came): a streaming client saw nothing more until the model finished."""
    s = ToolCallStream(CallFormat.TAGGED, TOOLS)
    shown = "".join(s.feed(piece)[0] for piece in ["Tools are called with the <tool_call> tag", ", which wraps",
                                                   " a JSON object naming the function and its arguments."])
    assert shown.startswith("Tools are called with the <tool_call> tag, which wraps a JSON object")


@pytest.mark.parametrize("fmt, named, pieces", [
    (CallFormat.ARGUMENTS, "stop_line", ['{"station": 4', "}"]),  # the name is known before the first token
    (CallFormat.TAGGED, None, [QWEN[:40], QWEN[40:130], QWEN[130:]]),  # a call ends and the next starts in one event
])
def test_each_streamed_chunk_carries_one_tool_call_delta(fmt, named, pieces):
    """OpenAI streams a call's id and name in one chunk and its arguments in later ones, one entry per chunk; an
    event that both opened a call and carried its arguments (or ended one call and opened the next) put two entries
    in one ``delta.tool_calls``, and a client reading ``delta.tool_calls[0]`` (common in Node-RED flows and hand
    SSE parsers) lost the arguments ('{"station": 4' never reached it) or the second call."""
    from lineside.runtime.request import FinishReason, TokenEvent
    from lineside.server import sse
    from lineside.server.outputs import ChoiceOutput, OutputOptions

    out = ChoiceOutput(OutputOptions(chat=True, call_format=fmt, tools=tuple(TOOLS), named=named))
    writer = sse.ChunkWriter(True, "chatcmpl-1", 0, model="m", include_usage=False)
    calls: dict[str, dict[str, str]] = {}
    ids: list[str] = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        event = TokenEvent(piece, [0], FinishReason.STOP if last else None, 1, i + 1)
        for chunk in out.chunks(writer, 0, event):
            entries = json.loads(chunk.removeprefix("data: "))["choices"][0]["delta"].get("tool_calls") or []
            assert len(entries) <= 1, entries
            for e in entries:  # the naive client: a delta with an id starts a call, the others add to the last
                if e.get("id"):
                    ids.append(e["id"])
                    calls[e["id"]] = {"name": e["function"]["name"], "arguments": e["function"].get("arguments", "")}
                else:
                    calls[ids[-1]]["arguments"] += e["function"]["arguments"]
    want = parse("".join(pieces), fmt, TOOLS, named=named)[1]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in want]


# OpenAPI inheritance / zod's .and(): a base model by $ref plus the object's own fields, applied together
PET = {"type": "function", "function": {"name": "add_pet", "parameters": {
    "$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
    "type": "object", "properties": {"pet": {"allOf": [
        {"$ref": "#/$defs/Base"},
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}, "required": ["name"]}]}},
    "required": ["pet"]}}}


@pytest.mark.parametrize("choice", ["required", "add_pet"])
def test_a_tool_whose_allof_refers_to_its_defs_can_be_called(tiny, choice):
    """Under required the parameters sit off the root, where closing objects did not find the $defs its allOf
    names: the base was closed alone, the call could never be written, and the request was a 400 (with another
    tool beside it, that tool was silently never called)."""
    import jsonschema

    tok, comp = tiny
    tools = parse_tools([PET, {"type": "function", "function": {"name": "noop", "parameters": {}}}])
    tc = parse_tool_choice(choice if choice == "required" else {"type": "function", "function": {"name": choice}},
                           tools)
    c = tool_constraint(tools, tc)
    args = {"pet": {"id": 1, "name": "rex"}}
    text = json.dumps([{"name": "add_pet", "arguments": args}] if choice == "required" else args)
    ids = tok.encode(text, add_special=False)
    m = comp.matcher(c)
    assert m.validate(ids) == len(ids)
    jsonschema.validate(args, PET["function"]["parameters"])
    bad = text.replace('"rex"}', '"rex", "x": 1}')  # still closed: no invented key in the pet
    assert comp.matcher(c).validate(tok.encode(bad, add_special=False)) < len(bad)


@pytest.mark.parametrize("text", ['[TOOL_CALLS]get_weather[ARGS]{"city": "Ly',
                                  '[TOOL_CALLS]stop_line[ARGS]{"station": 2} and then',
                                  'Sure [TOOL_CALLS] [{"name": "stop_line", "arguments": {"station": 2}}',
                                  "[TOOL_CALLS]stop_line"])
def test_a_mistral_call_cut_off_or_malformed_is_content(text):
    """Arguments cut at max_tokens, text after a call, an unclosed array or a name with no [ARGS]: no call (as
    vLLM's parser answers then), the whole output the content, streamed or not."""
    assert parse(text, CallFormat.MISTRAL, TOOLS) == (text, [])
    for step in (1, 4):
        content, _, s = _stream(text, CallFormat.MISTRAL, step=step)
        assert content == text and s.calls == []


@pytest.mark.parametrize("text, fmt", [(DS_V3, CallFormat.DEEPSEEK_V3), (DS_V31, CallFormat.DEEPSEEK_V31)])
def test_deepseek_arguments_stream_before_the_call_ends(text, fmt):
    """Fed a character at a time, the first call's name goes out once known and its arguments in pieces, each
    before the call's end marker arrives, not all at once when it is whole."""
    s = ToolCallStream(fmt, TOOLS)
    end = text.index("<｜tool▁call▁end｜>")
    pieces = [d for ch in text[:end] for d in s.feed(ch)[1]]
    assert pieces[0].name == "get_weather" and len([d for d in pieces if d.arguments]) > 5
    assert "".join(d.arguments for d in pieces) == parse(text, fmt, TOOLS)[1][0].arguments


@pytest.mark.parametrize("text, fmt", [
    (DS_V31, CallFormat.DEEPSEEK_V3),  # V3.1's markup read as V3's
    (DS_V3, CallFormat.DEEPSEEK_V31),
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>stop_line<｜tool▁sep｜>{station: 1}<｜tool▁call▁end｜>',
     CallFormat.DEEPSEEK_V31),  # arguments that are no JSON
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>stop_line<｜tool▁sep｜>"go"<｜tool▁call▁end｜>', CallFormat.DEEPSEEK_V31),
    ('OK <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>stop_line\n```json\n{"station": ',
     CallFormat.DEEPSEEK_V3),  # cut off at max_tokens
    (DS_V31[:DS_V31.rindex("<｜tool▁call▁end｜>")], CallFormat.DEEPSEEK_V31),  # the second call cut off
    (DS_V3.replace("```<｜tool▁call▁end｜>\n", "<｜tool▁call▁end｜>\n"), CallFormat.DEEPSEEK_V3),  # no closing fence
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>stop_line<｜tool▁sep｜>{"station": 1}<｜tool▁call▁end｜> and then',
     CallFormat.DEEPSEEK_V31),  # text where the next call or the calls' end belongs
    ("<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>", CallFormat.DEEPSEEK_V31),
])
def test_a_deepseek_call_cut_off_or_malformed_is_content(text, fmt):
    """A call cut off at max_tokens, markup of the other version, arguments that are no JSON object, a fence or an
    end marker missing, no call in the markers: no call, the whole output the content (as vLLM's deepseek parsers
    answer when their parse fails), streamed or not."""
    assert parse(text, fmt, TOOLS) == (text, [])
    for step in (1, 4):
        content, _, s = _stream(text, fmt, step=step)
        assert content == text and s.calls == []


@pytest.mark.parametrize("text", [
    DS_V32,  # V3.2's block read as V4's: no call
    DS_V4[:DS_V4.rindex("</｜DSML｜tool_calls>")],  # the block never closes (cut off at max_tokens)
    DS_V4[:DS_V4.rindex('<｜DSML｜parameter name="station"')],  # the second call cut off
    DS_V4.replace('string="false">7<', 'string="false">seven<'),  # a non-string value that is no JSON
    DS_V4.replace('string="false">7<', 'string="false">NaN<'),  # Python's json reads NaN; JSON has none
    DS_V4.replace('string="false">7<', 'string="false">-Infinity<'),
    DS_V4.replace('name="unit" string="true">C', 'name="city" string="true">Oslo'),  # a parameter twice
    DS_V4.replace('"stop_line"', '"launch_rocket"'),  # an unknown function
    DS_V4.replace('name="unit" string="true"', 'name="unit"'),  # no string attribute
    DS_V4.replace("</｜DSML｜invoke>\n<｜DSML｜invoke", "</｜DSML｜invoke>\nand<｜DSML｜invoke"),  # text between calls
    "<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",  # no call in the block
])
def test_a_dsml_call_cut_off_or_malformed_is_content(text):
    """As vLLM's deepseek_v32 / deepseek_v4 parsers answer when their parse fails: no call, the whole output the
    content, streamed or not."""
    assert parse(text, CallFormat.DEEPSEEK_V4, TOOLS) == (text, [])
    for step in (1, 5):
        content, _, s = _stream(text, CallFormat.DEEPSEEK_V4, step=step)
        assert content == text and s.calls == []


def test_dsml_arguments_stream_a_parameter_at_a_time():
    """Fed a character at a time, the first call's name goes out with its invoke tag and its arguments as each
    parameter closes, before the invoke's end arrives; together they are the whole parse's arguments."""
    s = ToolCallStream(CallFormat.DEEPSEEK_V4, TOOLS)
    end = DS_V4.index("</｜DSML｜invoke>")
    pieces = [d for ch in DS_V4[:end] for d in s.feed(ch)[1]]
    assert pieces[0].name == "get_weather"
    assert [d.arguments for d in pieces[1:]] == ["{", '"city": "Lyon"', ', "unit": "C"']
    rest = [d for d in s.feed(DS_V4[end:])[1] if d.index == 0]
    assert "".join(d.arguments for d in pieces + rest) == parse(DS_V4, CallFormat.DEEPSEEK_V4, TOOLS)[1][0].arguments


def test_dsml_parser_names_and_auto():
    """--tool-call-parser deepseek_v32 / deepseek_v4 (vLLM's names); auto picks them from a template that writes the
    block (a Jinja port of the encoder), and V3's markup stays V3's."""
    auto = parse_tool_choice("auto", TOOLS)
    assert call_format(auto, None, "deepseek_v4") == CallFormat.DEEPSEEK_V4
    assert call_format(auto, None, "deepseek_v32") == CallFormat.DEEPSEEK_V32
    assert call_format(auto, "{{ '<｜DSML｜tool_calls>' }}") == CallFormat.DEEPSEEK_V4
    assert call_format(auto, "{{ '<｜DSML｜function_calls>' }}") == CallFormat.DEEPSEEK_V32
    assert call_format(auto, "{{ '<｜tool▁call▁begin｜>' }}") == CallFormat.DEEPSEEK_V31


def test_consecutive_user_messages_are_one_only_where_the_template_refuses_them():
    """Gemma-style templates (raise unless roles alternate) get two user messages in a row as one; a template that
    takes them (ChatML) gets them as sent."""
    from lineside.runtime.chat_template import alternates
    from tests.server.test_tools_strict_templates import GEMMA_TEMPLATE

    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert alternates(GEMMA_TEMPLATE) and not alternates(chatml)
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    none = parse_tool_choice(None, [])
    assert template_messages(msgs, [], GEMMA_TEMPLATE, none)[0] == [{"role": "user", "content": "a\n\nb"}]
    assert template_messages(msgs, [], chatml, none)[0] == msgs


@pytest.mark.parametrize("text, content, calls", [
    # Llama 3.x: a call, then prose about it
    ('{"name": "stop_line", "parameters": {"station": 12}}\n\nI asked for line 12 to stop.',
     "I asked for line 12 to stop.", [("stop_line", '{"station": 12}')]),
    # two calls, the second cut off by max_tokens: the first stands, the second's text is content
    ('{"name": "stop_line", "parameters": {"station": 12}}; {"name": "get_weather", "parameters": {"city": "Os',
     '{"name": "get_weather", "parameters": {"city": "Os', [("stop_line", '{"station": 12}')]),
    # the required grammar's array cut inside its second call
    ('[{"name": "stop_line", "arguments": {"station": 2}}, {"name": "get_weather", "arguments": {"ci',
     '{"name": "get_weather", "arguments": {"ci', [("stop_line", '{"station": 2}')]),
    # a second object naming no tool, and text after a closed array
    ('{"name": "stop_line", "parameters": {"station": 3}} {"name": "launch", "parameters": {}}',
     '{"name": "launch", "parameters": {}}', [("stop_line", '{"station": 3}')]),
    ('[{"name": "stop_line", "arguments": {"station": 4}}]\nDone.', "Done.", [("stop_line", '{"station": 4}')]),
])
def test_json_text_after_the_calls_is_content(text, content, calls):
    """What follows Llama-style JSON calls (prose, a call cut off or naming no tool) is the content, streamed or
    not, as the other formats keep text after their calls: it was dropped, so a client lost the model's words
    (and a cut second call vanished without a trace while finish_reason said length)."""
    got_content, got_calls = parse(text, CallFormat.JSON, TOOLS)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for step in (1, 5):
        s_content, s_calls, s = _stream(text, CallFormat.JSON, step=step)
        assert s_content == content
        assert [(c.name, c.arguments) for c in s.calls] == calls


@pytest.mark.parametrize("text, fmt", [
    ('<tool_call>\n{"name": "stop_line", "arguments": null}\n</tool_call>', CallFormat.TAGGED),
    ('{"name": "stop_line", "parameters": null}', CallFormat.JSON),
    ('<tool_call>{"name": "stop_line", "arguments": "null"}</tool_call>', CallFormat.TAGGED),
    ('[TOOL_CALLS] [{"name": "stop_line", "arguments": null}]', CallFormat.MISTRAL),
])
def test_null_arguments_are_an_empty_object(text, fmt):
    """A model writing ``"arguments": null`` for a call without arguments: ``{}``, what OpenAI sends then; "null"
    went to the client, whose ``json.loads`` gave None where every SDK reads an object of arguments."""
    _, calls = parse(text, fmt, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("stop_line", "{}")]
    for step in (1, 4):
        content, streamed, _ = _stream(text, fmt, step=step)
        assert (content, [(c["name"], c["arguments"]) for c in streamed]) == ("", [("stop_line", "{}")])


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a </tool_call> b", "unit": "C"}}\n</tool_call>',
     None, [("get_weather", '{"city": "a </tool_call> b", "unit": "C"}')]),
    ('Sure.\n<tool_call>[{"name": "stop_line", "arguments": {"station": 2}}, {"name": "get_weather", "arguments": '
     '{"city": "x</tool_call><tool_call>y", "unit": "F"}}]</tool_call>\nDone.', "Sure.\n\nDone.",
     [("stop_line", '{"station": 2}'), ("get_weather", '{"city": "x</tool_call><tool_call>y", "unit": "F"}')]),
])
def test_a_closing_tag_inside_the_arguments_strings_does_not_end_the_call(text, content, calls):
    """Arguments that hold ``</tool_call>`` in a string (code, a prompt about tool calls): the call ends at the tag
    after its JSON, streamed or not; the tag in the string ended it there, and the whole call was text."""
    got_content, got_calls = parse(text, CallFormat.TAGGED, TOOLS)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for step in (1, 3, 8):
        s_content, s_calls, _ = _stream(text, CallFormat.TAGGED, step=step)
        assert (s_content, [(c["name"], c["arguments"]) for c in s_calls]) == (content or "", calls)


def test_a_string_never_closed_before_the_tag_is_still_no_call():
    """The other side: a string that never closes (malformed) does not swallow the tag and the call after it in
    the whole answer; the broken call is text, the next one a call."""
    broken = '<tool_call>{"name": "stop_line", "arguments": {"station": "2}}</tool_call>'
    text = broken + '\n<tool_call>{"name": "stop_line", "arguments": {"station": 3}}</tool_call>'
    content, calls = parse(text, CallFormat.TAGGED, TOOLS)
    assert (content, [(c.name, c.arguments) for c in calls]) == (broken, [("stop_line", '{"station": 3}')])
