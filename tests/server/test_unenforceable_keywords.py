"""JSON Schema keywords structured outputs cannot enforce while generating (uniqueItems, not, if/then/else, ...):
a 400 that names the keyword and where it sits in the client's schema, the same for response_format, a tool's
parameters (tool_choice required or named) and the Responses API's text.format. The grammar engine's own
wording ("invalid JSON schema: Unimplemented keys: [...]") named neither the place nor what to do, and called a
valid schema invalid."""

from __future__ import annotations

import json

import httpx
import pytest

from lineside.runtime.structured import UNENFORCEABLE, Constraint, ConstraintError, GrammarCompiler
from tests.tiny_tokenizer import write_byte_tokenizer

TAGS = {"type": "object", "properties": {"name": {"type": "string"},
                                         "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["name", "tags"]}
CASES = [  # (schema, the keyword, where it is)
    (TAGS, "uniqueItems", "#/properties/tags"),
    ({"type": "object", "properties": {"not": {"type": "object", "properties": {"x": {"not": {"const": 1}}}}}},
     "not", "#/properties/not/properties/x"),  # a property named "not" is a name, not the keyword
    ({"type": "object", "properties": {"a": {"type": "string"}}, "if": {"properties": {"a": {"const": "x"}}},
      "then": {"required": ["b"]}}, "if", "the schema's root"),
    ({"type": "object", "$defs": {"P": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}},
      "properties": {"p": {"$ref": "#/$defs/P"}}}, "dependentSchemas", "#/$defs/P"),
    ({"type": "object", "properties": {"l": {"anyOf": [{"type": "null"}, {"type": "array", "contains": {}}]}}},
     "contains", "#/properties/l/anyOf/1"),
]


def _check(message: str, keyword: str, where: str) -> None:
    assert f'"{keyword}"' in message and where in message and "remove" in message, message
    assert "Unimplemented" not in message and "invalid" not in message and "\n" not in message, message


@pytest.mark.parametrize("schema, keyword, where", CASES)
def test_response_format(server, schema, keyword, where):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema", err
    _check(err["message"], keyword, where)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "tag"}}])
def test_tool_parameters(server, choice):
    tools = [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "tag", "parameters": TAGS, "strict": True}}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": tools, "tool_choice": choice})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[1].function.parameters" and err["message"].startswith(err["param"] + ":"), err
    _check(err["message"], "uniqueItems", "#/properties/tags")


@pytest.mark.parametrize("fields, param", [
    ({"text": {"format": {"type": "json_schema", "name": "r", "schema": TAGS, "strict": True}}}, "text.format.schema"),
    ({"tools": [{"type": "function", "name": "tag", "parameters": TAGS, "strict": True}], "tool_choice": "required"},
     "tools[0].parameters"),
])
def test_responses_api(server, fields, param):
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={"input": "hi", "max_output_tokens": 16, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    _check(err["message"], "uniqueItems", "#/properties/tags")


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from lineside.runtime.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    return GrammarCompiler.for_tokenizer(Tokenizer(d, {"eos_token_ids": [2]}), 300, [2])


@pytest.mark.parametrize("keyword", sorted(UNENFORCEABLE))
def test_each_listed_keyword_is_one_the_grammar_engine_refuses(compiler, keyword):
    """The list is the grammar engine's: a keyword it learns to enforce must leave the list (and be accepted)."""
    from llguidance import LLMatcher

    from lineside.runtime.structured import JSON_OPTIONS

    schema = json.dumps({"type": "object", keyword: {}})
    m = LLMatcher(compiler.tokenizer, LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), log_level=0)
    assert m.is_error() and keyword in m.get_error(), m.get_error()
    with pytest.raises(ConstraintError):
        compiler.compile(Constraint.json_schema({"type": "object", keyword: {}}))


SHARED_DEFS = {"Tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
               "Name": {"type": "string"}, "Named": {"$ref": "#/$defs/Name"}}


def test_a_definition_no_ref_reaches_is_not_refused(compiler):
    """A schema that carries a shared ``$defs`` block but references only some of it: the grammar engine compiles
    only what the schema reaches, so an unenforceable keyword in an unused definition constrains nothing and the
    schema was accepted before the keyword walk; the walk refused it for a definition nothing uses."""
    schema = {"type": "object", "properties": {"name": {"$ref": "#/$defs/Named"}}, "required": ["name"],
              "$defs": SHARED_DEFS}
    compiler.compile(Constraint.json_schema(schema))
    used = {**schema, "properties": {**schema["properties"], "tags": {"$ref": "#/$defs/Tags"}}}
    with pytest.raises(ConstraintError) as e:  # once a ref reaches it, it is refused where it is
        Constraint.json_schema(used)
    _check(str(e.value), "uniqueItems", "#/$defs/Tags")


def test_a_keyword_inside_content_schema_is_not_refused(compiler):
    """``contentSchema`` describes the JSON a string holds (with ``contentMediaType``): an annotation, which JSON
    Schema does not validate and the grammar engine does not read, so a keyword inside it constrains nothing."""
    schema = {"type": "object", "properties": {"doc": {"type": "string", "contentMediaType": "application/json",
                                                       "contentSchema": {"type": "array", "uniqueItems": True}}}}
    m = compiler.matcher(Constraint.json_schema(schema))
    ids = compiler.tokenizer.tokenize_bytes(b'{"doc": "[1,1]"}')  # repeated items: the annotation is not applied
    assert all(m.accept(t) for t in ids) and m.accepting
