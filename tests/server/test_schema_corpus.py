"""Real-world schemas (tests/server/schema_corpus.py) through the server: sampled answers at temperature 1 from a
random tiny model, several seeds each, wander through the grammar; every complete one validates with jsonschema
(Draft 2020-12, formats checked) and pydantic reads the ones from pydantic models. As response_format (strict and
not) and as a tool's parameters under tool_choice required. A cut answer (finish_reason length) is a prefix."""

from __future__ import annotations

import ipaddress
import json
import re
from datetime import date

import httpx
import pytest
from jsonschema import Draft202012Validator, FormatChecker

from tests.server.conftest import running_server
from tests.server.schema_corpus import SCHEMAS, Measures, Owner, Person, Stamps, Tree

# A template that takes the tools and shows none of them: the grammar writes the calls, and a tiny context (256)
# cannot hold a schema the byte tokenizer spells a token a character.
TEMPLATE = ("{# tools are not rendered #}{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MODELS = {"person": Person, "measures": Measures, "stamps": Stamps, "owner": Owner, "tree": Tree}
N, MAX_TOKENS = 3, 160

_DATE = r"(\d{4})-(\d{2})-(\d{2})"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([zZ]|[+-]([01]\d|2[0-3]):[0-5]\d)"  # RFC 3339 (leap second)
FORMATS = FormatChecker()  # jsonschema's own (email, ipv4, ipv6, uuid, date, ...) and RFC 3339 / 3986's grammars


def _full_date(m: re.Match) -> bool:
    try:
        return bool(date(int(m.group(1)), int(m.group(2)), int(m.group(3))))
    except ValueError:
        return False


@FORMATS.checks("date-time")
def _date_time(s: object) -> bool:
    return not isinstance(s, str) or bool((m := re.fullmatch(_DATE + "[tT]" + _TIME, s)) and _full_date(m))


@FORMATS.checks("time")
def _time(s: object) -> bool:
    return not isinstance(s, str) or re.fullmatch(_TIME, s) is not None


@FORMATS.checks("uri")
def _uri(s: object) -> bool:  # RFC 3986: a scheme, then characters a URI may hold
    return not isinstance(s, str) or re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*",
                                                  s) is not None


@FORMATS.checks("hostname")
def _hostname(s: object) -> bool:
    return not isinstance(s, str) or (len(s) <= 253 and all(
        re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", p) for p in s.split(".")))


assert FORMATS.conforms("1998-12-31T23:59:60Z", "date-time") and not FORMATS.conforms("2023-02-30T00:00:00Z",
                                                                                       "date-time")
assert ipaddress  # (jsonschema's ipv4 / ipv6 checks use it)


@pytest.fixture(scope="module")
def srv(tiny_bundle):
    with running_server(tiny_bundle, num_slots=4, threads=1, chat_template=TEMPLATE) as s:
        ids = httpx.post(s.url + "/tokenize", timeout=30, json={"prompt": '"]},', "add_special_tokens": False})
        # the tokens that close strings, arrays and objects: favoured, so a random model's answers end in the budget
        s.bias = {str(t): 4 for t in ids.json()["tokens"]}
        yield s


def _check(name: str, text: str, finish: str, done: list[str]) -> None:
    if finish == "length":
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)  # cut: a prefix of an answer, never a whole other one
        return
    value = json.loads(text)
    errors = [e.message for e in Draft202012Validator(SCHEMAS[name], format_checker=FORMATS).iter_errors(value)]
    assert not errors, (name, text, errors)
    if name in MODELS:
        MODELS[name].model_validate_json(text)
    done.append(text)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_answers_validate(srv, name):
    done: list[str] = []
    for seed, strict in ((1, True), (11, False)):
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": f"Give a {name}."}], "n": N, "seed": seed, "temperature": 1,
            "max_tokens": MAX_TOKENS, "logit_bias": srv.bias,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": name, "schema": SCHEMAS[name], "strict": strict}}})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            _check(name, c["message"]["content"], c["finish_reason"], done)
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": f"Call {name}."}], "n": N, "seed": 21, "temperature": 1,
        "max_tokens": MAX_TOKENS, "logit_bias": srv.bias, "tool_choice": "required", "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {"name": name, "parameters": SCHEMAS[name]}}]})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        if c["finish_reason"] == "length":
            continue  # the cut call is left in the text, not parsed
        assert c["finish_reason"] == "tool_calls", c
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == name
        _check(name, call["function"]["arguments"], "stop", done)
    assert done, f"no answer for {name} ended within {MAX_TOKENS} tokens"
