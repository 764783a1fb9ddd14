"""Grammars past the grammar engine's limits are the client's mistake: one 400 ``invalid_request_error`` naming the
limit before the request is admitted, on every endpoint, streamed or not. A huge counted repetition (``a{300000}``)
compiled and gave a first mask, then failed on the first generated token as a 500 ``engine_error`` (streamed: an
error event); 100,000 ``guided_choice`` strings ran 20 s into the engine's panic text."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lineside.runtime.structured import (
    MAX_CHOICES,
    MAX_ENUM_VALUES,
    Constraint,
    ConstraintError,
    GrammarCompiler,
)
from tests.tiny_tokenizer import write_byte_tokenizer

HUGE = "a{300000}"  # llguidance: "lexer error: too many expressions constructed" at the first 'a'


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from lineside.runtime.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    return GrammarCompiler.for_tokenizer(Tokenizer(d, {"eos_token_ids": [2]}), 300, [2])


@pytest.mark.parametrize("constraint", [
    Constraint.regex(HUGE), Constraint.regex(f"(b|{HUGE})"), Constraint.regex(f"[0-9]{{3}}-{HUGE}"),
    Constraint.json_schema({"type": "object", "properties": {"s": {"type": "string", "pattern": f"^{HUGE}$"}},
                            "required": ["s"]}),
])
def test_a_limit_hit_once_generating_is_refused_at_compile(compiler, constraint):
    with pytest.raises(ConstraintError) as e:
        compiler.compile(constraint)
    msg = str(e.value)
    assert msg.startswith(constraint.param + ":") and "too many expressions constructed" in msg, msg
    assert "smaller repetition" in msg and "\n" not in msg, msg


def test_grammars_within_the_limits_still_generate(compiler):
    """The walk at compile time leaves a grammar it accepts at its start: a matcher still takes the whole answer."""
    c = Constraint.regex("a{5000}")
    compiler.compile(c)
    m = compiler.matcher(c)
    a = compiler.tokenizer.tokenize_bytes(b"a")[0]
    assert all(m.accept(a) for _ in range(5000)) and m.error is None and m.accepting


def test_choice_and_enum_count_is_capped(compiler):
    """The limits are what compiles and generates: one more choice than MAX_CHOICES passed the first mask and
    failed at the first token (the engine's 2,000 items per parser row), which the compile-time walk now sees."""
    choices = [f"option {i}" for i in range(MAX_CHOICES + 1)]
    compiler.compile(Constraint.choice(choices[:MAX_CHOICES]))
    with pytest.raises(ConstraintError, match="Current row has"):  # past the limit, the engine's own refusal
        compiler.compile(Constraint(Constraint.choice(choices[:MAX_CHOICES]).kind, json.dumps(choices), "x"))
    with pytest.raises(ConstraintError, match=rf"^guided_choice: {MAX_CHOICES + 1} choices are more than the "
                                              rf"{MAX_CHOICES}") as refused:
        Constraint.choice(choices)
    assert f"up to {MAX_ENUM_VALUES})" in str(refused.value) and "{" not in str(refused.value)  # the numbers, filled in
    values = [f"option {i}" for i in range(MAX_ENUM_VALUES + 1)]
    compiler.compile(Constraint.json_schema({"enum": values[:MAX_ENUM_VALUES]}))
    with pytest.raises(ConstraintError, match=rf'^guided_json: an "enum" lists more than {MAX_ENUM_VALUES} values'):
        Constraint.json_schema({"type": "object", "properties": {"k": {"enum": values}}}, param="guided_json")
    # a value that merely holds a list named "enum" is data, not a schema
    Constraint.json_schema({"const": {"enum": values}})


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PATTERN = {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^{HUGE}$"}}, "required": ["s"]}
CASES = [  # (path, body, the field the 400 names)
    ("/v1/chat/completions", {**CHAT, "guided_regex": HUGE}, "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": PATTERN}}}, "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": HUGE}},
     "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_choice": [str(i) for i in range(100_000)]},
     "guided_choice"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "text": {"format": {
        "type": "json_schema", "name": "r", "schema": PATTERN}}}, "text.format.schema"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body, param", CASES)
def test_endpoints_answer_400_before_admission(server, path, body, param, stream):
    r = httpx.post(server.url + path, json={**body, "stream": stream}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"].startswith(param + ":") and "\n" not in err["message"], err
    assert "panic" not in err["message"], err


def test_openai_client_sees_a_bad_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=CHAT["messages"], max_tokens=4, stream=True,
                                       extra_body={"guided_regex": HUGE})
    assert "too many expressions constructed" in e.value.message
