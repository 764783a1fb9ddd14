"""``date-time`` / ``time`` strings kept off the leap second (:60) that RFC 3339's grammar, and so the grammar
engine, allows in any minute, which pydantic (OpenAI's ``.parse()``) and Python's datetime refuse."""

from __future__ import annotations

import datetime as dt
import json
import random

import numpy as np
import pytest
from pydantic import TypeAdapter

from lineside.runtime.schema_formats import no_leap_seconds
from lineside.runtime.structured import Constraint, ConstraintError
from tests.runtime.conftest import BYTE_EOS, grammar_takes


@pytest.fixture(scope="module")
def compiler(byte_grammar):
    return byte_grammar


@pytest.mark.parametrize("fmt, kind, leap, ok", [
    ("date-time", dt.datetime, "2024-06-30T12:34:60Z", "2024-06-30t12:34:59.5+02:00"),
    ("time", dt.time, "12:34:60Z", "23:59:59z"),
])
def test_no_leap_second_and_pydantic_reads_every_walk(compiler, fmt, kind, leap, ok):
    c = Constraint.json_schema({"type": "string", "format": fmt})
    assert not grammar_takes(compiler, c, json.dumps(leap)) and grammar_takes(compiler, c, json.dumps(ok))
    reader = TypeAdapter(kind)
    for seed in range(150):  # answers drawn uniformly from each step's mask
        rng, m, out = random.Random(seed), compiler.matcher(c), []
        while not m.finished and len(out) < 60:
            t = int(rng.choice(np.flatnonzero(m.allowed())))
            if t == BYTE_EOS:
                break
            assert m.accept(t)
            out.append(t)
        if m.accepting:
            reader.validate_json(bytes(compiler.tokenizer.decode_bytes(out)))


def test_a_pattern_already_there_is_kept(compiler):
    schema = {"type": ["string", "null"], "format": "time", "pattern": "^0"}
    c = Constraint.json_schema(schema)
    assert grammar_takes(compiler, c, '"09:00:00Z"') and grammar_takes(compiler, c, "null")
    assert not grammar_takes(compiler, c, '"19:00:00Z"') and not grammar_takes(compiler, c, '"09:00:60Z"')
    assert no_leap_seconds({"enum": [{"format": "time"}]}) == {"enum": [{"format": "time"}]}  # data, not a schema


def test_an_overlapping_one_of_says_what_to_change(compiler):
    """The engine told clients to enable its 'coerce_one_of' option, which no request can set, and called the valid
    schema invalid."""
    with pytest.raises(ConstraintError) as e:
        compiler.compile(Constraint.json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]},
                                                param="response_format"))
    msg = str(e.value)
    assert all(n in msg for n in ("oneOf", "anyOf", "disjoint")), msg
    assert "coerce_one_of" not in msg and "invalid JSON schema" not in msg, msg
    assert msg.startswith("response_format: ") and "\n" not in msg
