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
    MAX_REPEATED_LENGTH,
    Constraint,
    ConstraintError,
    ConstraintKind,
    GrammarCompiler,
)
from tests.server.conftest import metric
from tests.tiny_tokenizer import write_byte_tokenizer

HUGE = "a{300000}"  # llguidance: "lexer error: too many expressions constructed" at the first 'a'


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from lineside.runtime.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    return GrammarCompiler.for_tokenizer(Tokenizer(d, {"eos_token_ids": [2]}), 300, [2])


def _unchecked(kind: ConstraintKind, text: str, param: str) -> Constraint:
    """A constraint past the validation's repetition cap, to test the compile's walk behind it."""
    return Constraint(kind, text, param)


@pytest.mark.parametrize("constraint", [
    _unchecked(ConstraintKind.REGEX, HUGE, "guided_regex"),
    _unchecked(ConstraintKind.REGEX, f"(b|{HUGE})", "guided_regex"),
    _unchecked(ConstraintKind.REGEX, f"[0-9]{{3}}-{HUGE}", "guided_regex"),
    _unchecked(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"s": {
        "type": "string", "pattern": f"^{HUGE}$"}}, "required": ["s"]}), "guided_json"),
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


@pytest.mark.parametrize("make, value, param, most", [
    (Constraint.regex, "a{10001}", "guided_regex", 10_001),
    (Constraint.regex, "[bc]{12}a{1000000}", "guided_regex", 1_000_000),  # behind more than the walk's 8 bytes
    (Constraint.regex, "a{1000}{1000}", "guided_regex", 1_000_000),
    (Constraint.regex, "(ab){99999}", "guided_regex", 199_998),
    (Constraint.regex, "(?:x(?P<y>yz){100}){60}", "guided_regex", 12_060),
    (Constraint.regex, "(yes|no){4000}", "guided_regex", 12_000),  # a group of alternatives: its longest
    (Constraint.json_schema, {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a{200}){60}$"}}},
     "guided_json", 12_000),
    (Constraint.json_schema, {"type": "object", "patternProperties": {"^k{20000}$": {"type": "integer"}}},
     "guided_json", 20_000),
    (Constraint.grammar, 'start: "ab"{6000}\n', "guided_grammar", 12_000),
    (Constraint.grammar, "start: /x{3}(yz){9000}/\n", "guided_grammar", 18_000),
])
def test_repetitions_past_the_cap_are_refused_at_validation(make, value, param, most):
    """Counts multiplied through nesting, at their lower bound: such a grammar never reaches the compiler."""
    with pytest.raises(ConstraintError) as e:
        make(value, param=param)
    assert str(e.value) == (f"{param}: a counted repetition spells out {most} characters, more than the "
                            f"{MAX_REPEATED_LENGTH} structured outputs allow; give smaller counts {{n}} (an optional "
                            "part {0,n} costs nothing) or a character class with *"), str(e.value)


@pytest.mark.parametrize("pattern, match", [
    ("a{10000}", "a" * 10000), ("a{0,100000}", "aaa"), ("[a-z]{3,}x{2}", "abcxx"), (r"\p{L}{5}\x{41}{3}", "abcdeAAA"),
    ("(ab){5000}", "ab" * 5000), (r"\{2000000\}", "{2000000}"), ("[{]{7}", "{" * 7), ("(a|b){6000}", "ab" * 3000),
    ("(x|(ab){5}){900}", "x" * 900)])
def test_repetitions_within_the_cap_compile(compiler, pattern, match):
    """The cap counts only what is spelt out: optional parts, escaped or bracketed braces are not repetitions, and
    a group of alternatives counts its longest (it spelt out their sum with the "|"). Each compiles, and its matcher
    takes a whole match."""
    m = compiler.matcher(Constraint.regex(pattern))
    ids = compiler.tokenizer.tokenize_bytes(match.encode())
    assert all(m.accept(t) for t in ids) and m.error is None and m.accepting, pattern


def test_a_refusal_is_cached_and_named_after_each_request_field(compiler):
    """A refused grammar is compiled once: a client repeating it gets the cached refusal, under its own field."""
    text = HUGE + "b"
    before = compiler.stats.refused
    for param in ("guided_regex", "structured_outputs.regex", "guided_regex"):
        with pytest.raises(ConstraintError) as e:
            compiler.compile(_unchecked(ConstraintKind.REGEX, text, param))
        assert str(e.value).startswith(param + ": this regular expression is past the grammar engine's limits"), e.value
        assert e.value.param == param
    assert compiler.stats.refused == before + 1 and compiler.stats.refusal_hits >= 2


def test_the_refusal_cache_is_bounded(tmp_path):
    from lineside.runtime.tokenizer import Tokenizer

    write_byte_tokenizer(tmp_path, 300)
    small = GrammarCompiler(Tokenizer(tmp_path, {"eos_token_ids": [2]})._tok.to_str(), 300, [2], max_entries=2)
    for i in range(4):
        with pytest.raises(ConstraintError):
            small.compile(Constraint.regex(f"a{i}(" ))  # does not parse
    assert small.stats.refused == 4 and len(small._refused) == 2


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
    assert "counted repetition spells out 300000 characters" in e.value.message


# past the engine's 2,000 items per parser row 12 bytes in: compiles, then fails while generating
LATE = 'start: /[bc]{12}/ (' + " | ".join(f'"o{i}"' for i in range(2500)) + ')\n'
LATE_CASES = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 20, "guided_grammar": LATE}, "guided_grammar"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 20, "structured_outputs": {"grammar": LATE}},
     "structured_outputs.grammar"),
]
LATE_MESSAGE = "this grammar is past the grammar engine's limits once generating (Parser Error: Current row has 2501"


@pytest.mark.parametrize("path, body, param", LATE_CASES)
def test_a_limit_met_mid_generation_is_a_400_before_anything_is_sent(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "grammar_too_large", err
    assert err["message"].startswith(f"{param}: {LATE_MESSAGE}") and "\n" not in err["message"], err
    assert err["param"] == param, err  # as the compile-time 400s name the field


@pytest.mark.parametrize("path, body, param", LATE_CASES)
def test_a_limit_met_mid_stream_is_an_invalid_request_error_event_then_done(server, path, body, param):
    """As vLLM ends a stream that fails once started: an error event, then [DONE]; the other requests go on."""
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]", lines
        err = json.loads(lines[-2])["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "grammar_too_large", err
        assert err["message"].startswith(f"{param}: {LATE_MESSAGE}") and err["param"] == param, err
        ok = client.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length"), ok.text



@pytest.mark.parametrize("stream", [False, True])
def test_a_limit_met_mid_generation_is_counted_as_the_clients_not_the_engines(server, stream):
    """/metrics counts it as the 400s are (outcome "invalid"), not as the engine's failure (outcome "error")."""
    path, body, _ = LATE_CASES[1]
    before = httpx.get(server.url + "/metrics").text
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + path, json={**body, "stream": stream}) as r:
            text = r.read().decode()
    assert "grammar_too_large" in text, text
    after = httpx.get(server.url + "/metrics").text
    counted = {o: metric(after, "lineside_requests_total", f'outcome="{o}"')
               - metric(before, "lineside_requests_total", f'outcome="{o}"') for o in ("invalid", "error")}
    assert counted == {"invalid": 1, "error": 0}, counted
