"""JSON Schema ``format`` values the grammar engine does not know (pydantic's "binary" for bytes, "password" for
SecretStr, "path" for Path, OpenAPI's "int64"): annotations, left out of the grammar, not a 400 "invalid JSON
schema: Unknown format" for a valid schema. The bodies are the ones langchain-openai 1.8.1's ChatOpenAI sent for
``with_structured_output(Upload, method=...)`` with ``Upload`` a pydantic model of a Path, bytes and a SecretStr."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lineside.runtime.schema_formats import ENFORCED_FORMATS, without_unenforced_formats
from lineside.runtime.structured import JSON_OPTIONS, Constraint, ConstraintError, GrammarCompiler
from tests.server.conftest import running_server
from tests.tiny_tokenizer import write_byte_tokenizer

UPLOAD = {"description": "A file to upload.",
          "properties": {"path": {"format": "path", "title": "Path", "type": "string"},
                         "data": {"format": "binary", "title": "Data", "type": "string"},
                         "token": {"format": "password", "title": "Token", "type": "string", "writeOnly": True}},
          "required": ["path", "data", "token"], "title": "Upload", "type": "object", "additionalProperties": False}
# ChatOpenAI(...).with_structured_output(Upload, method="json_schema").invoke("Upload notes.txt")
JSON_SCHEMA_BODY = {"model": "tiny-llama", "stream": False, "messages": [{"content": "Upload notes.txt", "role": "user"}],
                    "max_completion_tokens": 60, "temperature": 0.0,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"schema": UPLOAD, "name": "Upload", "strict": True}}}
# ChatOpenAI(...).with_structured_output(Upload, method="function_calling").invoke("Upload notes.txt")
FUNCTION_CALLING_BODY = {
    "model": "tiny-llama", "stream": False, "messages": [{"content": "Upload notes.txt", "role": "user"}],
    "max_completion_tokens": 60, "parallel_tool_calls": False, "temperature": 0.0,
    "tool_choice": {"type": "function", "function": {"name": "Upload"}},
    "tools": [{"type": "function", "function": {"name": "Upload", "description": "A file to upload.", "parameters": {
        k: v for k, v in UPLOAD.items() if k not in ("title", "description", "additionalProperties")}}}]}


@pytest.fixture(scope="module")
def smol(smol_bundle):
    """SmolLM2 (context 1024): the tiny Llama's byte-level tokenizer spends a token per character, and the tool's
    schema its template renders into the prompt is 500 of them, past its 256."""
    with running_server(smol_bundle, num_slots=1, threads=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from lineside.runtime.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    return GrammarCompiler.for_tokenizer(Tokenizer(d, {"eos_token_ids": [2]}), 300, [2])


def _engine_error(compiler, schema: dict) -> str | None:
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    m = LLMatcher(compiler.tokenizer, grammar, log_level=0)
    return m.get_error() if m.is_error() else None


@pytest.mark.parametrize("fmt", sorted(ENFORCED_FORMATS))
def test_each_kept_format_is_one_the_grammar_engine_enforces(compiler, fmt):
    """The kept list is the engine's: one it stops knowing must leave the list (else its schemas are 400s again)."""
    assert _engine_error(compiler, {"type": "string", "format": fmt}) is None


@pytest.mark.parametrize("fmt", ["binary", "password", "path", "int64", "uri-reference", "json-string"])
def test_an_unknown_format_is_one_the_engine_refuses_and_is_left_out(compiler, fmt):
    schema = {"type": "string", "format": fmt}
    assert "Unknown format" in (_engine_error(compiler, schema) or ""), fmt  # why they are left out
    assert without_unenforced_formats(schema) == {"type": "string"}
    compiler.compile(Constraint.json_schema(schema))  # left out where every schema is compiled


def test_formats_are_left_out_at_every_schema_position_and_names_stay():
    schema = {"type": "object", "properties": {
        "format": {"type": "string", "format": "binary"},  # a property named "format": a name, kept
        "when": {"type": "string", "format": "date-time"},  # enforced: kept
        "files": {"type": "array", "items": {"$ref": "#/$defs/File"}},
        "maybe": {"anyOf": [{"type": "string", "format": "path"}, {"type": "null"}]}},
        "$defs": {"File": {"type": "object", "properties": {"data": {"type": "string", "format": "byte"}},
                           "additionalProperties": {"type": "integer", "format": "int64"}}}}
    before = json.dumps(schema)
    out = without_unenforced_formats(schema)
    assert json.dumps(schema) == before  # the request's schema is not changed in place
    assert out["properties"]["format"] == {"type": "string"}
    assert out["properties"]["when"]["format"] == "date-time"
    assert out["properties"]["maybe"]["anyOf"][0] == {"type": "string"}
    assert out["$defs"]["File"]["properties"]["data"] == {"type": "string"}
    assert out["$defs"]["File"]["additionalProperties"] == {"type": "integer"}
    assert "format" not in json.dumps(out).replace('"format": {', "").replace('"format": "date-time"', "")
    text = json.dumps({"type": "string", "format": "binary"})  # guided_json may be JSON text
    assert without_unenforced_formats(text) == {"type": "string"}
    assert without_unenforced_formats("not json") == "not json"  # left for the constraint's own 400
    plain = {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}
    assert without_unenforced_formats(plain) is plain  # nothing to leave out: compiled as sent


def test_an_enforced_format_still_constrains(compiler):
    m = compiler.matcher(Constraint.json_schema(without_unenforced_formats({"type": "string", "format": "date"})))
    ids = list(compiler.tokenizer.tokenize_bytes(b'"hello"'))
    assert m.validate(ids) < len(ids)  # not a date
    with pytest.raises(ConstraintError):  # the other checks still run on the cleaned schema
        Constraint.json_schema(without_unenforced_formats({"type": "array", "format": "binary", "uniqueItems": True}))


@pytest.mark.parametrize("body", [JSON_SCHEMA_BODY, pytest.param(FUNCTION_CALLING_BODY, marks=pytest.mark.slow)],
                         ids=["json_schema", "function_calling"])
def test_langchain_structured_output_bodies_are_served(request, body):
    server = request.getfixturevalue("server" if body is JSON_SCHEMA_BODY else "smol")
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={k: v for k, v in body.items() if k != "model"})  # the served model
    assert r.status_code == 200, r.text  # was 400 "invalid JSON schema: Unknown format: path"
    message = r.json()["choices"][0]["message"]
    if body is FUNCTION_CALLING_BODY:
        assert message["tool_calls"][0]["function"]["name"] == "Upload", message
        text = message["tool_calls"][0]["function"]["arguments"]
    else:
        text = message["content"]
    assert text.startswith('{"path": "'), text  # the grammar still holds: the schema's first property


def test_openai_client_response_format_and_responses_text_format(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"blob": {"type": "string", "format": "binary"}}, "required": ["blob"]}
    chat = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": schema}})
    assert chat.choices[0].message.content.startswith('{"blob": "')
    resp = client.responses.create(model="tiny-llama", input="hi", max_output_tokens=16,
                                   text={"format": {"type": "json_schema", "name": "b", "schema": schema}})
    assert resp.output_text.startswith('{"blob": "')
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "guided_json": schema})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith('{"blob": "'), r.text


@pytest.mark.slow
def test_openai_client_tool_choice_required(smol):
    """tool_choice required nests each tool's parameters in one grammar: their unknown formats are left out there too."""
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"blob": {"type": "string", "format": "binary"}}, "required": ["blob"]}
    tools = [{"type": "function", "function": {"name": "put", "parameters": schema}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
    required = client.chat.completions.create(messages=[{"role": "user", "content": "Store the word hello."}],
                                              model="smollm2", max_tokens=40, temperature=0, tools=tools,
                                              tool_choice="required")  # was a 400 for tools[0]'s "binary"
    calls = required.choices[0].message.tool_calls
    assert calls and all(json.loads(c.function.arguments) is not None for c in calls), required
