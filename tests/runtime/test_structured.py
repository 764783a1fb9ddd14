"""Grammar-constrained decoding on a tiny byte-level tokenizer (every byte one token) and on SmolLM2:
whatever the logits, a constrained generation parses against its constraint; the compile cache; the errors."""

from __future__ import annotations

import json
import re
from enum import Enum

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field

from lineside.errors import LinesideError
from lineside.runtime.sampling import Sampler, SamplingParams
from lineside.runtime.structured import (
    Constraint,
    ConstraintError,
    ConstraintKind,
    GrammarCompiler,
    fill_masks,
    new_bitmask,
    unpack_bitmask,
)
from tests.tiny_tokenizer import write_byte_tokenizer

VOCAB = 300  # as the tiny test checkpoints: 3 specials + 256 bytes + unused ids
EOS = 2


class Defect(str, Enum):
    scratch = "scratch"
    dent = "dent"
    crack = "crack"


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict mode has it
    name: str = Field(max_length=12)
    count: int = Field(ge=1, le=99)


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid")
    defect: Defect
    station: str = Field(pattern=r"^ST-[0-9]{2}$")
    severity: float = Field(ge=0, le=10)
    parts: list[Part] = Field(max_length=3)
    notes: str | None = Field(default=None, max_length=20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, VOCAB)
    from lineside.runtime.tokenizer import Tokenizer

    tok = Tokenizer(d, {"bos_token_id": 1, "eos_token_ids": [EOS]})
    return tok, GrammarCompiler.for_tokenizer(tok, VOCAB, [EOS])


def _generate(compiler, tok, c: Constraint, seed: int, max_tokens: int = 400, temperature: float = 1.0,
              closing: str = ""):
    """Random logits (a model that knows nothing) through the sampler under the grammar mask; the
    ``closing`` characters are favoured so free-form JSON ends within ``max_tokens``."""
    rng = np.random.default_rng(seed)
    m = compiler.matcher(c)
    s = Sampler(SamplingParams(temperature=temperature, seed=seed))
    out = []
    for _ in range(max_tokens):
        logits = rng.standard_normal(VOCAB).astype(np.float32) * 3
        logits[EOS] += 4.0  # ending early is likely wherever the grammar allows it
        for ch in closing:
            logits[tok.encode(ch, add_special=False)[0]] += 6.0
        t = s.step(logits, allowed=m.allowed()).token
        assert m.accept(t), m.error
        if t == EOS:
            break
        out.append(t)
        if m.finished:
            break
    assert m.finished or m.accepting, "ran out of tokens before the grammar completed"
    return tok.decode(out)


@pytest.mark.parametrize("text, ok", [
    ('{"a": [1, 2.5, -3e2], "b": {"c": [{"d": null}, {}]}, "e": ["x", "y"], "f": [true, false], "g": [[1], []]}',
     True),
    ('{"k": "with \\"escapes\\" and é", "n": null, "t": true}', True),
    ('{"parts": [{"name": "belt"}, "cause"], "": 1}', True),  # any JSON: mixed arrays, any key
    ('[1, 2]', False),  # an object, not any JSON value
    ('{"a":1}', False),  # written with the separators of json.dumps, no free whitespace
])
def test_json_object_is_any_object_written_compactly(tiny, text, ok):
    tok, comp = tiny
    ids = tok.encode(text, add_special=False)
    m = comp.matcher(Constraint.json_object())
    assert (m.validate(ids) == len(ids)) == ok
    if ok:
        assert all(m.accept(t) for t in ids) and m.accepting
        json.loads(text)


@pytest.mark.parametrize("seed", range(12))
def test_schema_outputs_validate_whatever_the_logits(tiny, seed):
    tok, comp = tiny
    text = _generate(comp, tok, Constraint.json_schema(Report.model_json_schema()), seed)
    report = Report.model_validate_json(text)  # raises ValidationError if it does not parse against the schema
    assert report.model_dump(mode="json", exclude_unset=True) == json.loads(text)  # nothing beyond its fields


@pytest.mark.parametrize("seed", range(6))
def test_regex_choice_json_object_and_lark(tiny, seed):
    tok, comp = tiny
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", _generate(comp, tok, Constraint.regex(r"[A-Z]{2}-[0-9]{3}"), seed))
    assert _generate(comp, tok, Constraint.choice(["press", "weld", "paint shop"]), seed) in {
        "press", "weld", "paint shop"}
    assert isinstance(json.loads(_generate(comp, tok, Constraint.json_object(), seed, closing='"}]')), dict)
    lark = 'start: "ok" | "error " NUM\nNUM: /[0-9]{1,3}/'
    assert re.fullmatch(r"ok|error [0-9]{1,3}", _generate(comp, tok, Constraint.grammar(lark), seed))
    gbnf = 'root ::= "yes" | "no"'
    assert _generate(comp, tok, Constraint.grammar(gbnf), seed) in {"yes", "no"}


def test_greedy_under_a_mask_picks_the_best_allowed_token(tiny):
    tok, comp = tiny
    m = comp.matcher(Constraint.choice(["b", "c"]))
    logits = np.zeros(VOCAB, dtype=np.float32)
    ids = {ch: tok.encode(ch, add_special=False)[0] for ch in "abc"}
    logits[ids["a"]], logits[ids["b"]], logits[ids["c"]] = 9.0, 1.0, 2.0
    assert Sampler(SamplingParams()).step(logits, allowed=m.allowed()).token == ids["c"]
    assert Sampler(SamplingParams())(logits) == ids["a"]  # without a mask: unchanged


def test_grammar_completion_ends_the_request(tiny):
    tok, comp = tiny
    m = comp.matcher(Constraint.regex("ab"))
    for t in tok.encode("ab", add_special=False):
        assert not m.finished
        assert m.accept(t)
    assert m.finished  # nothing but the end can follow: the engine stops without sampling EOS
    assert not comp.matcher(Constraint.regex("ab")).accept(tok.encode("x", add_special=False)[0])


def test_compile_cache_keys_on_the_constraint_not_the_field(tiny):
    _, comp = tiny
    before = (comp.stats.compiled, comp.stats.hits)
    schema = {"type": "object", "properties": {"cache_probe": {"type": "integer"}}}
    comp.matcher(Constraint.json_schema(schema, param="response_format"))
    comp.matcher(Constraint.json_schema(json.dumps(schema), param="guided_json"))
    assert (comp.stats.compiled, comp.stats.hits) == (before[0] + 1, before[1] + 1)
    a, b = comp.matcher(Constraint.regex("x+")), comp.matcher(Constraint.regex("x+"))
    assert a is not b and a._m is not b._m  # each request its own state


def test_matchers_are_independent_and_roll_back(tiny):
    tok, comp = tiny
    x, y = (tok.encode(ch, add_special=False)[0] for ch in "xy")
    a, b = comp.matcher(Constraint.regex("xy")), comp.matcher(Constraint.regex("xy"))
    assert a.accept(x) and a.accept(y) and a.finished and not b.finished
    a.rollback(1)
    assert not a.finished and a.allowed()[y] and not a.allowed()[x]
    assert b.validate([x, y]) == 2 and b.validate([y]) == 0


def test_batched_masks_equal_one_by_one(tiny):
    tok, comp = tiny
    ms = [comp.matcher(Constraint.regex("[a-c]+")), comp.matcher(Constraint.choice(["zz"])),
          comp.matcher(Constraint.json_object())]
    bm = new_bitmask(4, VOCAB)
    fill_masks([(m, r) for r, m in zip((0, 2, 3), ms, strict=True)], bm)
    rows = unpack_bitmask(bm, VOCAB)
    assert rows[1].all()  # an unconstrained row is left allowing everything
    for r, m in zip((0, 2, 3), ms, strict=True):
        assert (rows[r] == m.allowed()).all()
    assert rows[0].sum() == 3 and rows[2].sum() == 1


PAD_EOS = 276  # an EOS id among the model's padding rows: past the tokenizer's 259 tokens, inside the 300 rows


@pytest.fixture(scope="module")
def padded(tiny):
    """A compiler whose EOS ids include one past the tokenizer (generation_config naming a padding row)."""
    tok, _ = tiny
    return tok, GrammarCompiler.for_tokenizer(tok, VOCAB, [EOS, PAD_EOS])


def test_an_eos_id_past_the_tokenizer_is_an_eos_of_the_grammar(padded):
    """llguidance checked EOS ids against the tokenizer's 259 tokens (ValueError: EOS token ID 276 is out of
    range); the mask covers the model's 300 ids, the padding ones never allowed but the EOS among them, which
    is allowed where EOS is and ends the grammar."""
    tok, comp = padded
    assert comp.tokenizer_size == 259 and comp.eos_ids == [EOS, PAD_EOS]
    m = comp.matcher(Constraint.regex("ab"))
    a, b = tok.encode("ab", add_special=False)
    assert np.flatnonzero(m.allowed()).tolist() == [a]
    assert m.accept(a) and m.accept(b)
    assert np.flatnonzero(m.allowed()[259:]).tolist() == [PAD_EOS - 259] and m.allowed()[EOS]
    assert m.accept(PAD_EOS) and m.finished
    free = comp.matcher(Constraint.regex("[a-z]*"))
    assert np.flatnonzero(free.allowed()[259:]).tolist() == [PAD_EOS - 259]  # EOS allowed at once, no padding
    assert comp.token_bytes(PAD_EOS) == comp.token_bytes(280) == b"" and comp.token_bytes(EOS) == b"</s>"


def test_a_grammar_naming_a_padding_id_can_never_be_matched(padded):
    """Lark's <[id]> names any id; a padding row (no token behind it) stays masked, so the grammar is refused."""
    _, comp = padded
    with pytest.raises(ConstraintError, match="never be matched"):
        comp.compile(Constraint.grammar("start: <[280]>"))
    assert comp.matcher(Constraint.grammar("start: <[65]>")).allowed()[65]


def test_batched_masks_keep_padding_ids_off(padded):
    _, comp = padded
    ms = [comp.matcher(Constraint.regex("[a-z]*")), comp.matcher(Constraint.json_object())]
    bm = new_bitmask(3, VOCAB)
    fill_masks([(ms[0], 0), (ms[1], 2)], bm)
    rows = unpack_bitmask(bm, VOCAB)
    assert rows[1].all() and (rows[0] == ms[0].allowed()).all() and (rows[2] == ms[1].allowed()).all()
    assert not rows[2, 259:].any() and rows[0, 259:].sum() == 1


def test_a_tokenizer_bigger_than_the_model_is_one_line(tiny):
    tok, _ = tiny
    with pytest.raises(LinesideError, match="tokenizer has ids up to 258 but the model's vocabulary only 200"):
        GrammarCompiler.for_tokenizer(tok, 200, [EOS])


@pytest.mark.parametrize("make, param, words", [
    (lambda: Constraint.json_schema({"type": "no-such-type"}), "response_format.json_schema.schema", "invalid"),
    (lambda: Constraint.json_schema("{not json", param="guided_json"), "guided_json", "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2], param="guided_json"), "guided_json", "must be an object"),
    (lambda: Constraint.regex("a{3,1}"), "guided_regex", "invalid"),
    (lambda: Constraint.regex("(?!x)y"), "guided_regex", "look-around"),
    (lambda: Constraint.regex("[a&&b]"), "guided_regex", "never be matched"),
    (lambda: Constraint.choice([]), "guided_choice", "non-empty list"),
    (lambda: Constraint.grammar("start: undefined_rule"), "guided_grammar", "invalid grammar"),
    # past what a compile may hold: refused before llguidance sees it (see the deep-chain test below)
    (lambda: Constraint.json_schema({"anyOf": [{"type": "integer"}] * 10_000}, param="tools"), "tools",
     "more than 10000 JSON objects"),
    (lambda: Constraint.grammar("start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(2000))),
     "guided_grammar", "more than 2000 lines"),
    (lambda: Constraint.grammar('start: %json {"properties": {' + ", ".join(f'"p{i}": {{}}' for i in range(2000))
                                + "}}"), "guided_grammar", "inline JSON objects"),
])
def test_bad_constraints_are_one_line_naming_the_field(tiny, make, param, words):
    _, comp = tiny
    with pytest.raises(ConstraintError) as e:
        comp.compile(make())
    assert e.value.param == param
    msg = str(e.value)
    assert msg.startswith(param + ":") and words in msg and "\n" not in msg


_DEEP_CHAIN = """
import sys, threading
from pathlib import Path
from lineside.runtime.structured import Constraint, ConstraintError, GrammarCompiler
from tests.tiny_tokenizer import write_byte_tokenizer

write_byte_tokenizer(Path(sys.argv[1]), 300)
comp = GrammarCompiler((Path(sys.argv[1]) / "tokenizer.json").read_text(), 300, [2])
n = 1500  # 4,502 JSON objects: a chain of objects each reached through a $ref
schema = {"$defs": {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                              "required": ["a"]} for i in range(n)} | {f"d{n}": {"type": "string"}},
          "$ref": "#/$defs/d0"}
grammar = "start: r0\\n" + "".join(f"r{i}: r{i + 1}\\n" for i in range(1900)) + 'r1900: "a"'
def compile_all():  # on a worker thread with the default stack, as the server's asyncio.to_thread
    for c in (Constraint.json_schema(schema), Constraint.grammar(grammar)):
        comp.compile(c)
        print("compiled", comp.matcher(c).allowed().any(), flush=True)
t = threading.Thread(target=compile_all)
t.start()
t.join()
"""


def test_a_deep_reference_chain_compiles_instead_of_killing_the_process(tmp_path):
    """A schema whose $refs chain 1,500 objects deep (or a Lark grammar of 1,900 chained rules) overflowed the
    8 MB stack of the thread llguidance compiled it on: SIGSEGV, the whole server gone, no 400. Compiles run on
    a thread with a larger stack; the run is a child process so a crash fails this test, not the session."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _DEEP_CHAIN, str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=root)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-800:]}"
    assert r.stdout.split() == ["compiled", "True", "compiled", "True"], r.stderr[-800:]


def _patterned(i: int) -> dict:
    return {"type": "string", "pattern": f"x.{{{i}}}y"}


def _pattern_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"allOf": [_patterned(i), {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n - 1)}
    return {"$defs": {**defs, f"d{n - 1}": _patterned(n - 1)}, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize("schema", [
    {"allOf": [_patterned(i) for i in range(30)]},
    {"type": "string", "allOf": [{"anyOf": [_patterned(i)]} for i in range(30)]},
    {"type": "object", "allOf": [{"properties": {"id": _patterned(i)}} for i in range(30)]},
    _pattern_chain(30),
], ids=["allOf", "anyOf-in-allOf", "same-property", "ref-chain"])
def test_patterns_intersected_past_the_engines_reach_are_refused_before_compiling(schema):
    """llguidance intersects the patterns that apply to one string, and its emptiness check of 30 of them grew
    past 12 GB in seconds (24: 17 s, 2 GB) whatever limits it was given: one request could take the server down.
    Refused by counting them, before anything is compiled."""
    with pytest.raises(ConstraintError, match="more than 10 \"pattern\"s apply to one string") as e:
        Constraint.json_schema(schema, param="guided_json")
    assert e.value.param == "guided_json"


def test_patterns_that_are_not_intersected_are_not_counted_together(tiny):
    """Many patterns on different properties, branches or items, and a pydantic model behind ``allOf: [$ref]``,
    compile as before; so do ten patterns on one string."""
    tok, comp = tiny
    many = {f"f{i}": _patterned(i) for i in range(40)}
    for schema, instance in (({"type": "object", "properties": many}, '{"f2": "xaay"}'),
                             ({"anyOf": list(many.values())}, '"xaaay"'),
                             ({"type": "array", "prefixItems": list(many.values())}, '["xy", "xay"]'),
                             ({"$defs": {"M": {"type": "object", "properties": many}}, "type": "object",
                               "properties": {"m": {"allOf": [{"$ref": "#/$defs/M"}], "description": "d"}}},
                              '{"m": {"f1": "xay"}}'),
                             ({"allOf": [{"type": "string", "pattern": "[a-z]*"}] * 10}, '"abc"')):
        m = comp.matcher(Constraint.json_schema(schema))
        ids = tok.encode(instance, add_special=False)
        assert all(m.accept(t) for t in ids) and m.accepting, instance


def test_a_grammar_intersecting_past_the_engines_reach_is_refused_before_compiling(tiny):
    """Lark's ``&`` intersects lexemes as allOf intersects patterns, at the same exponential cost (22: 3 s,
    600 MB); ``&`` inside strings, regular expressions and character classes intersects nothing and still
    compiles."""
    lexemes = " & ".join(f"/.*x.{{{i}}}y.*/" for i in range(30))
    with pytest.raises(ConstraintError, match="intersects \\(&\\) more than 10 times") as e:
        Constraint.grammar(f"start: X\nX: {lexemes}\n", param="guided_grammar")
    assert e.value.param == "guided_grammar"
    _, comp = tiny
    comp.compile(Constraint.grammar('start: "&&&&&&" X "&&&&&&" // &&&&&&\nX: /[a-z&&[^q]]+&&&&&&/ & /.*a.*/\n'))


def test_constraint_values():
    assert Constraint.json_object().kind == ConstraintKind.JSON_OBJECT
    assert Constraint.json_schema({"a": 1}, param="x") == Constraint.json_schema('{"a": 1}', param="y")
    assert Constraint.json_schema(True).text == "{}"


@pytest.mark.slow
def test_smollm2_follows_the_schema(smol_bundle):
    """The real model, greedy, on extraction prompts: each output parses against the schema and the
    grammar ends the generation."""
    from lineside.runtime.generate import Generator

    g = Generator(smol_bundle, threads=1)
    comp = GrammarCompiler.for_tokenizer(g.tokenizer, g.backend.vocab_size, g.eos_ids)
    c = Constraint.json_schema(Report.model_json_schema())
    for text in ["ST-07 press: crack in the upper die, 2 bolts loose; severity 7.",
                 "Station ST-12: scratch on door panel (1 panel); polish it.",
                 "ST-03 weld cell: dent in bracket x4, severity 2, notes: night shift"]:
        ids = g.tokenizer.encode_chat([{"role": "user", "content": f"Report this defect as JSON: {text}"}])
        m = comp.matcher(c)
        out = list(g.stream(ids, 200, matcher=m))
        assert m.finished
        Report.model_validate_json(g.tokenizer.decode(out))


def test_objects_with_properties_are_closed_unless_the_schema_says_otherwise():
    from lineside.runtime.structured import closed_objects

    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                          "c": {"type": "object", "properties": {}, "additionalProperties": True}},
         "$defs": {"D": {"properties": {"x": {}}}}, "default": {"properties": {}}}
    c = closed_objects(s)
    assert c["additionalProperties"] is False and c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["c"]["additionalProperties"] is True and c["$defs"]["D"]["additionalProperties"] is False
    assert c["default"] == {"properties": {}}  # data is left alone
    assert closed_objects({"type": "object"}) == {"type": "object"}  # json_object: any keys


# allOf members describe one object together (zod's .and(), OpenAPI inheritance: a base $ref plus its own
# fields), as do an object's properties and its anyOf / oneOf branches: closing each on its own forbids the
# others' keys, so the schema matched nothing.
ALL_OF = [
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
     "type": "object", "properties": {"pet": {"allOf": [
         {"$ref": "#/$defs/Base"},
         {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"]}]}},
     "required": ["pet"]},
    {"type": "object", "properties": {"kind": {"enum": ["x", "y"]}}, "required": ["kind"],
     "oneOf": [{"properties": {"kind": {"const": "x"}, "n": {"type": "integer"}}, "required": ["n"]},
               {"properties": {"kind": {"const": "y"}, "ok": {"type": "boolean"}}, "required": ["ok"]}]},
    # pydantic before 2.9 (and v1) wraps a nested model's $ref in allOf to give it a description
    {"$defs": {"Pet": {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string",
                                                                                          "maxLength": 5}},
                       "required": ["id", "name"]}},
     "type": "object", "properties": {"pet": {"allOf": [{"$ref": "#/$defs/Pet"}], "description": "the pet"}},
     "required": ["pet"]},
]


@pytest.mark.parametrize("schema", ALL_OF)
@pytest.mark.parametrize("seed", range(3))
def test_objects_applied_together_are_closed_together(tiny, schema, seed):
    import jsonschema

    tok, comp = tiny
    out = json.loads(_generate(comp, tok, Constraint.json_schema(schema), seed, closing='"}'))
    jsonschema.validate(out, schema)
    obj = out.get("pet", out)
    assert set(obj) in ({"a", "b"}, {"id", "name"}, {"kind", "n"}, {"kind", "ok"})  # no invented keys


@pytest.mark.parametrize("schema, invented", [
    (ALL_OF[1], '{"pet": {"id": 1, "name": "a", "x": 1}}'),
    (ALL_OF[3], '{"pet": {"id": 1, "name": "a", "x": 1}}'),
])
def test_an_invented_key_in_objects_applied_together_is_masked(tiny, schema, invented):
    tok, comp = tiny
    ids = tok.encode(invented, add_special=False)
    assert comp.matcher(Constraint.json_schema(schema)).validate(ids) < len(ids)


def test_a_required_key_the_properties_do_not_list_may_still_be_written(tiny):
    """Closing an object over its properties alone made a key that ``required`` names but ``properties`` does not
    (a loose hand-written or MCP tool schema) impossible: a valid schema was a 400 "Unsatisfiable schema"."""
    tok, comp = tiny
    c = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]})
    ok, extra = '{"a": 1, "b": [true]}', '{"a": 1, "b": 2, "c": 3}'
    assert comp.matcher(c).validate(ids := tok.encode(ok, add_special=False)) == len(ids)
    assert comp.matcher(c).validate(ids := tok.encode(extra, add_special=False)) < len(ids)


def test_a_grammar_after_a_token_leaves_the_text_before_it_free(tiny):
    """``after``: a reasoning model's grammar starts once it has written ``</think>`` (here "#"): before, every
    token is allowed and nothing is masked; proposals are validated across the switch; a rollback past it waits
    again."""
    tok, comp = tiny
    x, y, z, mark = (tok.encode(ch, add_special=False)[0] for ch in "xyz#")
    m = comp.matcher(Constraint.regex("xy"), after=mark)
    assert not m.active and m.allowed() is None and not m.finished
    assert m.validate([z, z, mark, x, y]) == 5 and m.validate([z, mark, y]) == 2 and m.validate([z, x]) == 2
    assert m.accept(z) and m.accept(y) and not m.finished  # free text, even what the grammar forbids
    bm = new_bitmask(2, VOCAB)
    fill_masks([(m, 1)], bm)
    assert unpack_bitmask(bm, VOCAB).all()  # a waiting row is left allowing everything
    assert m.accept(mark) and m.active
    assert m.allowed()[x] and m.allowed().sum() == 1
    assert m.accept(x) and m.accept(y) and m.finished
    m.rollback(2)
    assert m.active and m.allowed()[x] and not m.finished
    m.rollback(1)
    assert not m.active and m.allowed() is None
    assert m.accept(mark) and m.accept(x) and m.accept(y) and m.finished
