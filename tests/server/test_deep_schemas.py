"""Schemas nested deeper than the grammar engine reads: one 400 naming the field, the depth and what to do. The
engine's "recursion limit exceeded at line 1 column N" named no limit, and a schema nested a few hundred levels
(well inside what the body parser takes) overflowed Python's recursion in the schema walks: a 500."""

from __future__ import annotations

import httpx
import pytest

from lineside.runtime.structured import (
    MAX_SCHEMA_DEPTH,
    Constraint,
    ConstraintError,
    GrammarCompiler,
    nesting_depth,
)
from tests.tiny_tokenizer import write_byte_tokenizer


def nested(levels: int, kind: str) -> dict:
    """A schema of ``levels`` nested objects (two JSON levels each: the schema and its properties), optional values
    (anyOf: two) or arrays (one)."""
    s: dict = {"type": "integer"}
    for _ in range(levels):
        s = ({"type": "object", "properties": {"a": s}, "required": ["a"]} if kind == "object" else
             {"anyOf": [s, {"type": "null"}]} if kind == "optional" else {"type": "array", "items": s})
    return s


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from lineside.runtime.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    return GrammarCompiler.for_tokenizer(Tokenizer(d, {"eos_token_ids": [2]}), 300, [2])


def test_the_limit_is_the_engines(compiler):
    """The deepest schema accepted compiles; one level more is refused before the engine sees it."""
    deepest = nested(MAX_SCHEMA_DEPTH - 1, "array")
    assert nesting_depth(deepest) == MAX_SCHEMA_DEPTH
    compiler.compile(Constraint.json_schema(deepest))
    with pytest.raises(ConstraintError) as e:
        Constraint.json_schema(nested(MAX_SCHEMA_DEPTH, "array"), param="guided_json")
    assert str(e.value).startswith(f"guided_json: the schema nests {MAX_SCHEMA_DEPTH + 1} levels"), e.value
    assert "$defs" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("levels", [70, 450])
@pytest.mark.parametrize("kind", ["object", "optional"])
def test_response_format(server, kind, levels):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested(levels, kind)}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema", err
    assert "levels of JSON objects and arrays" in err["message"] and "$ref" in err["message"], err


@pytest.mark.parametrize("levels", [70, 450])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "deep"}}])
def test_tool_parameters(server, choice, levels):
    tools = [{"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "deep", "parameters": {
                 "type": "object", "properties": {"x": nested(levels, "object")}}}}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": tools, "tool_choice": choice})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[1].function.parameters", err
    assert "levels of JSON objects and arrays" in err["message"], err


def test_completions_guided_json(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 4, "guided_json": nested(450, "optional")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text
