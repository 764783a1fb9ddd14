"""Request fields → constraint, and the 400s naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lineside.runtime.structured import ConstraintKind, GrammarCompiler
from lineside.server.constraints import checked, request_constraint
from lineside.server.errors import APIError
from tests.tiny_tokenizer import write_byte_tokenizer


def _req(**kw):
    return SimpleNamespace(**kw)


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    from lineside.runtime.tokenizer import Tokenizer

    return GrammarCompiler.for_tokenizer(Tokenizer(d, {"eos_token_ids": [2]}), 300, [2])


@pytest.mark.parametrize("kw, kind, param", [
    ({"response_format": {"type": "json_object"}}, ConstraintKind.JSON_OBJECT, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"},
                                                                  "strict": True}}},
     ConstraintKind.JSON_SCHEMA, "response_format.json_schema.schema"),
    ({"guided_json": '{"type": "integer"}'}, ConstraintKind.JSON_SCHEMA, "guided_json"),
    ({"guided_regex": "[0-9]+"}, ConstraintKind.REGEX, "guided_regex"),
    ({"guided_choice": ["a", "b"]}, ConstraintKind.CHOICE, "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, ConstraintKind.GRAMMAR, "guided_grammar"),
    ({"structured_outputs": {"regex": "x+"}}, ConstraintKind.REGEX, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": True}}, ConstraintKind.JSON_OBJECT, "structured_outputs.json_object"),
])
def test_fields_map_to_constraints(compiler, kw, kind, param):
    c = checked(compiler, request_constraint(_req(**kw)))
    assert (c.kind, c.param) == (kind, param)


def test_text_and_nothing_are_free():
    assert request_constraint(_req(response_format={"type": "text"})) is None
    assert request_constraint(_req()) is None


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{oops"}, "guided_json"),
    ({"guided_regex": "[a&&b]"}, "guided_regex"),  # unsatisfiable
    ({"guided_regex": "(?<=x)y"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "guided_regex"),
])
def test_bad_fields_are_400_naming_them(compiler, kw, param):
    with pytest.raises(APIError) as e:
        checked(compiler, request_constraint(_req(**kw)))
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


@pytest.mark.parametrize("so, param", [
    ({"json_schema": {"type": "object"}}, "structured_outputs.json_schema"),  # a misspelt field: not free text
    ({"structural_tag": '{"type": "structural_tag"}'}, "structured_outputs.structural_tag"),
    ({"regex": "x+", "choise": ["a"]}, "structured_outputs.choise"),
])
def test_structured_outputs_keys_it_cannot_honour_are_400(compiler, so, param):
    """vLLM's StructuredOutputsParams refuses a key it does not have; dropped here, the answer was unconstrained."""
    with pytest.raises(APIError) as e:
        checked(compiler, request_constraint(_req(structured_outputs=so)))
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


def test_structured_outputs_options_this_server_always_has_are_accepted(compiler):
    so = {"json": {"type": "object"}, "disable_any_whitespace": True, "disable_additional_properties": True,
          "disable_fallback": True}
    assert checked(compiler, request_constraint(_req(structured_outputs=so))).param == "structured_outputs.json"
