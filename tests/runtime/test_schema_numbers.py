"""Number ranges under an exclusive whole-number bound whose other bound is less than one away (pydantic's
``Field(gt=0, le=0.5)``): the grammar engine's own range let the bound itself through ("0" for (0, 0.5], "-1" for
(-1.25, -1)), an answer jsonschema and pydantic refuse. Checked on the byte tokenizer, text by text and by walks."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from jsonschema import validators
from pydantic import BaseModel, Field, ValidationError

from lineside.runtime.schema_numbers import EPSILON, fix_number_ranges
from lineside.runtime.structured import Constraint
from tests.runtime.conftest import BYTE_EOS, grammar_takes


@pytest.fixture(scope="module")
def compiler(byte_grammar):
    return byte_grammar


class Rate(BaseModel):
    rate: float = Field(gt=0, le=0.5)


# (schema, the bound the engine let through, numbers inside the range)
CASES = [
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}, "0", ["0.5", "0.25", "0.000001"]),
    ({"type": "number", "exclusiveMinimum": -0.5, "exclusiveMaximum": 0}, "-0", ["-0.3", "-0.49"]),
    ({"type": "number", "exclusiveMinimum": -1.25, "exclusiveMaximum": -1}, "-1", ["-1.1", "-1.24"]),
    ({"type": "number", "minimum": -2.5, "exclusiveMaximum": -2}, "-2", ["-2.5", "-2.01"]),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1.75}, "1", ["1.75", "1.5"]),
    ({"type": ["number", "null"], "exclusiveMinimum": 2, "maximum": 2.5}, "2", ["2.5", "null"]),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0, "exclusiveMinimum": True,
      "maximum": 0.5}, "0", ["0.1"]),  # draft 4's boolean form
    ({"type": "number", "exclusiveMinimum": 5, "maximum": 5.5, "multipleOf": 0.5}, "5", ["5.5"]),
    (Rate.model_json_schema()["properties"]["rate"], "0", ["0.5"]),
]


@pytest.mark.parametrize("schema, bound, inside", CASES)
def test_the_exclusive_bound_is_refused_and_the_range_kept(compiler, schema, bound, inside):
    c = Constraint.json_schema(schema)
    assert not grammar_takes(compiler, c, bound), f"{bound} is outside {schema}"
    for text in inside:
        assert grammar_takes(compiler, c, text), f"{text} is inside {schema}"


def test_random_walks_validate(compiler):
    """Answers drawn uniformly from each step's mask (what temperature 1 on a random model wanders into) validate."""
    for schema, _, _ in CASES:
        c, v = Constraint.json_schema(schema), validators.validator_for(schema)(schema)
        for seed in range(30):
            rng, m, out = random.Random(seed), compiler.matcher(c), []
            for _ in range(12):
                t = int(rng.choice(np.flatnonzero(m.allowed())))
                if t == BYTE_EOS:
                    break
                assert m.accept(t)
                out.append(t)
            if m.accepting:
                text = bytes(compiler.tokenizer.decode_bytes(out)).decode()
                assert v.is_valid(json.loads(text)), (schema, text)


def test_pydantic_reads_every_answer_a_pydantic_range_allows(compiler):
    c = Constraint.json_schema(Rate.model_json_schema())
    assert not grammar_takes(compiler, c, '{"rate": 0}')
    with pytest.raises(ValidationError):
        Rate.model_validate_json('{"rate": 0}')
    assert Rate.model_validate_json('{"rate": 0.05}').rate == 0.05 and grammar_takes(compiler, c, '{"rate": 0.05}')


def test_ranges_the_engine_gets_right_are_left_as_given():
    for schema in ({"type": "number", "exclusiveMinimum": 0, "maximum": 1},  # one wide: the engine is right
                   {"type": "number", "exclusiveMinimum": 0.5, "maximum": 1},  # not a whole number
                   {"type": "integer", "exclusiveMinimum": 0, "maximum": 0.5},  # integers: no fractions
                   {"type": "number", "exclusiveMinimum": 0},
                   {"enum": [{"exclusiveMinimum": 0, "maximum": 0.5}]}):  # data, not a schema
        assert fix_number_ranges(json.loads(json.dumps(schema))) == schema
    fixed = fix_number_ranges({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-12})
    assert 0 < fixed["exclusiveMinimum"] < 1e-12 and fixed["exclusiveMinimum"] <= EPSILON  # a range narrower still
