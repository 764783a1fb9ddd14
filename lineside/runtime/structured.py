"""Grammar-constrained decoding: typed constraints, a compile cache per tokenizer, per-request matchers, token masks.

The grammar engine is llguidance (numpy only, no torch: what a Jetson runtime install can carry;
``benchmarks/structured_mask.py`` measured it against xgrammar). A ``Constraint`` is a plain value
(JSON schema, regex, choice, Lark/GBNF grammar); ``GrammarCompiler`` turns one into a checked grammar
once per tokenizer and keeps it, so a repeat schema costs a copy; each request gets its own
``GrammarMatcher``, whose packed mask the sampler applies to that row's logits and which is advanced
by every sampled token until the grammar is complete.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from lineside.errors import LinesideError
from lineside.runtime.grammar_vocab import readable_tokenizer_json
from lineside.runtime.schema_formats import no_leap_seconds, without_unenforced_formats
from lineside.runtime.schema_numbers import fix_number_ranges
from lineside.runtime.schema_walk import DATA_KEYS, schema_nodes

# JSON is generated compactly but readably (the separators of json.dumps), with no free whitespace:
# small models given free whitespace can pad a value with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance compiles a grammar by recursing along its references: a chain of a thousand $refs to objects (or a
# few thousand Lark rules) overflowed the 8 MB stack of the thread compiling it, and the SIGSEGV took the whole
# server down with no exception to turn into a 400. Grammars are compiled on a thread with a larger stack, and
# what one request may send is capped well inside it (and inside seconds of compile time): JSON objects in a
# schema (OpenAI allows 5,000 properties), and definitions in a grammar (its lines, plus any JSON object an
# inline %json schema may hold).
MAX_SCHEMA_OBJECTS = 10_000
# The grammar engine reads a schema with serde_json, whose recursion limit (128) leaves 124 levels of nested JSON
# objects and arrays for the schema itself (about 60 nested object properties: each is two levels). Past it the
# engine's "recursion limit exceeded at line 1 column N" named no limit and no remedy, and a schema nested a few
# hundred levels overflowed Python's own recursion in the walks below (a 500). Checked first, without recursion.
MAX_SCHEMA_DEPTH = 124
MAX_GRAMMAR_DEFINITIONS = 2_000
# llguidance intersects the ``pattern``s that apply to one string together (allOf members, a $ref beside other
# keywords, properties merged across them), and its emptiness check of that intersection costs time and memory
# exponential in how many there are, past every limit it takes: 20 cost 0.6 s and 200 MB, 24 cost 17 s and 2 GB,
# 30 ran a server out of memory. Below this the check takes milliseconds.
MAX_MERGED_PATTERNS = 10
# llguidance builds its lexer lazily: a regex past its size limits (``a{300000}`` in a guided_regex or a schema's
# "pattern": "lexer error: too many expressions constructed") compiles and gives a first mask, then fails on the
# first generated token, which ended the request as an engine error. A compile walks this many tokens past the
# first mask, on copies, along the lowest and the highest allowed id, so such a grammar is a 400 before admission.
PROBE_TOKENS = 8
# guided_choice: the grammar engine keeps one parser item per choice in a row of at most 2,000 (max_items_in_row),
# one taken by the rule itself, so 2,000 choices compiled and failed at the first token; 100,000 ran 20 s into a
# panic ("assertion failed: grammar.symbols.len() < u16::MAX"). A schema's "enum" is one lexeme: 10,000 values
# compile in about 0.05 s on a 2-core x86 machine, 100,000 in 0.4 s into "grammar too big". (OpenAI allows 1,000
# enum values per strict schema.)
MAX_CHOICES = 1_999
MAX_ENUM_VALUES = 10_000
# A counted repetition is spelt out by the grammar engine at its lower bound: a{100000} (or (ab){50000}) took 0.5 s
# to compile and 25 ms a token to mask on SmolLM2's vocabulary (2-core x86), slowing every request in the batch,
# and a{300000} is past its limits; a{10000} costs 0.04 s and under 3 ms a token. Counts multiply through nesting
# (a{1000}{1000} is a million). What a bounded range leaves optional ({0,n}) is not spelt out and is not counted.
MAX_REPEATED_LENGTH = 10_000
# llguidance's own texts for a grammar past its limits (derivre's lexer expressions and states, the Earley parser's
# items per row and per step, lexer fuel, grammar size): hit while generating they mean the request's grammar is too
# big (a huge repetition behind more free bytes than PROBE_TOKENS), so the request ends as the client's error.
LIMIT_ERRORS = ("too many expressions constructed", "too many states", "items; max is", "Too many items (limit",
                "fuel exhausted", "lex fuel", "derivatives with total fuel", "too big (limit for this grammar",
                "lexer precomputation failed", "relevance check fuel")
# A compile follows the text every output of a grammar must write, token by token while the mask holds one, this
# far: text this vocabulary cannot spell on it (a constant "x!" without a "!" piece) is a 400 before admission.
FORCED_STEPS = 64
COMPILE_STACK_BYTES = 256 << 20  # reserved address space; only the pages a deep grammar reaches are touched


class ConstraintKind(str, Enum):
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI response_format json_object)
    JSON_SCHEMA = "json_schema"  # an instance of this schema (response_format json_schema, guided_json)
    REGEX = "regex"  # the whole output matches (guided_regex)
    CHOICE = "choice"  # exactly one of these strings (guided_choice)
    GRAMMAR = "grammar"  # a Lark or GBNF (llama.cpp) grammar (guided_grammar)


class ConstraintError(LinesideError):
    """A constraint that cannot be compiled or can never be satisfied; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """What the output must match. ``text`` is canonical (a schema is dumped as compact JSON, key order kept) so equal
    constraints share one compiled grammar; ``param`` (the request field it came from) is left out of
    equality and only names the field in errors."""

    kind: ConstraintKind
    text: str
    param: str = field(default="", compare=False)

    @classmethod
    def json_object(cls, param: str = "response_format") -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT, '{"type": "object"}', param)

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format.json_schema.schema") -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"{param}: not valid JSON ({e.msg} at character {e.pos})", param) from None
        if isinstance(schema, bool):  # JSON Schema allows true (anything) / false (nothing)
            if not schema:
                raise ConstraintError(f"{param}: the schema `false` matches nothing", param)
            schema = {}
        if not isinstance(schema, dict):
            raise ConstraintError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param)
        check_depth(schema, param)
        schema = without_unenforced_formats(schema)  # an annotation the engine would refuse (schema_formats.py)
        if _largest_enum(schema) > MAX_ENUM_VALUES:
            raise ConstraintError(f"{param}: an \"enum\" lists more than {MAX_ENUM_VALUES} values, more than structured "
                                  "outputs compile; give fewer values (or a \"pattern\")", param)
        if _objects(schema) > MAX_SCHEMA_OBJECTS:
            raise ConstraintError(f"{param}: the schema holds more than {MAX_SCHEMA_OBJECTS} JSON objects; split it "
                                  "or share subschemas through $defs", param)
        check_enforceable(schema, param)
        for pattern in _patterns(schema):
            _check_repetitions(pattern, param)
        if merged_patterns(schema) > MAX_MERGED_PATTERNS:
            raise ConstraintError(f"{param}: more than {MAX_MERGED_PATTERNS} \"pattern\"s apply to one string "
                                  "together (through allOf or $ref), more than the grammar engine can intersect; "
                                  "merge them into fewer patterns", param)
        # Key order is kept: it is the order the model writes properties in.
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(no_leap_seconds(fix_number_ranges(closed_objects(schema))),
                                                   ensure_ascii=False),
                   param)

    @classmethod
    def regex(cls, pattern: Any, param: str = "guided_regex") -> Constraint:
        if not isinstance(pattern, str):
            raise ConstraintError(f"{param}: a regular expression must be a string", param)
        _check_repetitions(pattern, param)
        return cls(ConstraintKind.REGEX, pattern, param)

    @classmethod
    def choice(cls, options: Any, param: str = "guided_choice") -> Constraint:
        if (not isinstance(options, list | tuple) or not options
                or not all(isinstance(o, str) and o for o in options)):
            raise ConstraintError(f"{param}: give a non-empty list of non-empty strings", param)
        if len(options) > MAX_CHOICES:
            raise ConstraintError(f"{param}: {len(options)} choices are more than the {MAX_CHOICES} structured "
                                  f"outputs compile; give fewer (or a guided_json enum, up to {MAX_ENUM_VALUES})", param)
        return cls(ConstraintKind.CHOICE, json.dumps(list(options), ensure_ascii=False), param)

    @classmethod
    def grammar(cls, text: Any, param: str = "guided_grammar") -> Constraint:
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError(f"{param}: give the grammar as non-empty Lark or GBNF text", param)
        if text.count("\n") + text.count("{") >= MAX_GRAMMAR_DEFINITIONS:
            raise ConstraintError(f"{param}: the grammar has more than {MAX_GRAMMAR_DEFINITIONS} lines and inline "
                                  "JSON objects; give a smaller one", param)
        if text.count("&") > MAX_MERGED_PATTERNS and _intersections(text) > MAX_MERGED_PATTERNS:
            raise ConstraintError(f"{param}: the grammar intersects (&) more than {MAX_MERGED_PATTERNS} times, more "
                                  "than the grammar engine can check; give fewer intersections", param)
        _check_repetitions(text, param, grammar=True)
        return cls(ConstraintKind.GRAMMAR, text, param)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own form (raises ConstraintError for text it cannot read)."""
        from llguidance import LLMatcher, grammar_from

        try:
            if self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
                return LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
            if self.kind == ConstraintKind.REGEX:
                return LLMatcher.grammar_from_regex(self.text)
            if self.kind == ConstraintKind.CHOICE:
                return grammar_from("choice", self.text)
            return grammar_from("grammar", self.text)
        except ValueError as e:
            raise ConstraintError(f"{self.param or self.kind.value}: {_first_line(str(e))}", self.param) from None


# JSON Schema keywords the grammar engine cannot enforce while generating (llguidance: "Unimplemented keys"); a
# test checks each against the installed llguidance
UNENFORCEABLE = frozenset({"not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
                           "contains", "minContains", "maxContains", "uniqueItems", "propertyNames",
                           "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$dynamicAnchor",
                           "$recursiveRef", "$recursiveAnchor"})
# (not contentSchema: an annotation on a string's content, which neither JSON Schema nor the engine enforces)
_SUBSCHEMA = frozenset({"items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
                        "propertyNames", "unevaluatedItems", "unevaluatedProperties"})
_SUBSCHEMAS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})  # lists of schemas
_NAMED_SUBSCHEMAS = frozenset({"properties", "patternProperties", "dependentSchemas"})


def check_enforceable(schema: Any, param: str) -> None:
    """One line naming the first keyword of ``schema`` that structured outputs cannot enforce and the JSON pointer
    of the subschema holding it (the grammar engine's own "Unimplemented keys" named neither). Only schema
    positions are searched: a property named "not" is a name. A ``$defs`` / ``definitions`` entry is searched
    when a ``$ref`` reaches it: the grammar engine compiles only those, so one nothing uses constrains nothing
    (a shared block of definitions). Walked without recursion (schemas nest deep)."""
    defs = _definitions(schema)
    todo: list[tuple[Any, str]] = [(schema, "#")]
    seen: set[int] = set()
    while todo:
        node, at = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        found = next((k for k in node if k in UNENFORCEABLE), None)
        if found is not None:
            where = "the schema's root" if at == "#" else at
            raise ConstraintError(f"{param}: the keyword \"{found}\" at {where} cannot be enforced while the answer is "
                                  "generated; remove it from the schema (and check that rule on the answer)", param)
        children: list[tuple[Any, str]] = []
        for k, v in node.items():
            here = f"{at}/{_pointer_token(k)}"
            if k in _NAMED_SUBSCHEMAS and isinstance(v, dict):
                children.extend((s, f"{here}/{_pointer_token(n)}") for n, s in v.items())
            elif k in _SUBSCHEMAS and isinstance(v, list):
                children.extend((s, f"{here}/{i}") for i, s in enumerate(v))
            elif k in _SUBSCHEMA:
                children.append((v, here))
            elif k == "$ref" and isinstance(v, str) and v in defs:
                children.append((defs[v], v))
        todo.extend(reversed(children))  # depth first, in the schema's key order


def _intersections(grammar: str) -> int:
    """How many ``&`` (llguidance's Lark intersection of lexemes, as costly as intersected patterns) ``grammar``
    holds outside its string literals, regular expressions, character classes and ``//`` comments."""
    n, i, size = 0, 0, len(grammar)
    while i < size:
        ch = grammar[i]
        if grammar.startswith("//", i):
            i = grammar.find("\n", i)
            i = size if i < 0 else i
        elif ch in "\"/[":
            close = "]" if ch == "[" else ch
            i += 1
            while i < size and grammar[i] != close:
                i += 2 if grammar[i] == "\\" else 1
        elif ch == "&":
            n += 1
        i += 1
    return n


_MERGED_CHILDREN = ("items", "additionalProperties", "contains", "propertyNames")


def merged_patterns(schema: Any) -> int:
    """The most ``pattern`` keywords that apply to one value together, as the grammar engine merges schemas: a
    subschema with its ``allOf`` members and the ``$ref`` it names (and theirs), the same property (items,
    prefixItems entry) across those, and one branch of each ``anyOf`` / ``oneOf`` among them. Positions are
    walked without recursion (schemas nest deep), each set of subschemas once (a $ref may be reached often)."""
    defs = _definitions(schema)

    def together(nodes: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        todo, seen = list(nodes), set()
        while todo:
            node = todo.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            if isinstance(node.get("allOf"), list):
                todo.extend(node["allOf"])
            if isinstance(node.get("$ref"), str):
                todo.append(defs.get(node["$ref"]))
        return out

    def own(nodes: list[dict[str, Any]]) -> int:
        return sum(isinstance(n.get("pattern"), str) for n in nodes)

    most, todo, done = 0, [[schema]], set()
    while todo and len(done) < 4 * MAX_SCHEMA_OBJECTS:
        nodes = together(todo.pop())
        key = frozenset(map(id, nodes))
        if not nodes or key in done:
            continue
        done.add(key)
        groups = [n[k] for n in nodes for k in ("anyOf", "oneOf") if isinstance(n.get(k), list)]
        most = max(most, own(nodes) + sum(max((own(together([b])) for b in g), default=0) for g in groups))
        props: dict[str, list[Any]] = {}
        for n in nodes:
            for name, sub in (n.get("properties") if isinstance(n.get("properties"), dict) else {}).items():
                props.setdefault(name, []).append(sub)
            for k in ("prefixItems", "items"):  # (items as a list: the older prefixItems)
                for i, sub in enumerate(n.get(k) if isinstance(n.get(k), list) else []):
                    props.setdefault(f"/{i}", []).append(sub)
        todo.extend(props.values())
        todo.extend([n[k] for n in nodes if isinstance(n.get(k), dict)] for k in _MERGED_CHILDREN)
        todo.extend([b] for g in groups for b in g)
        todo.extend([s] for n in nodes if isinstance(n.get("patternProperties"), dict)
                    for s in n["patternProperties"].values())
    return most


def nesting_depth(value: Any) -> int:
    """How many JSON objects and arrays deep ``value`` nests (a scalar 0, ``{}`` 1, ``{"a": []}`` 2), counted
    without recursion: a request body may nest deeper than Python's stack."""
    most, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict | list):
            most = max(most, depth)
            todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return most


def check_depth(schema: Any, param: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """A ConstraintError when ``schema`` nests deeper than ``limit`` levels (what the grammar engine reads)."""
    if (depth := nesting_depth(schema)) > limit:
        raise ConstraintError(f"{param}: the schema nests {depth} levels of JSON objects and arrays, more than the "
                              f"{limit} structured outputs read; move nested subschemas into $defs and refer to them "
                              "with $ref (a $ref adds no nesting)", param)


def _objects(value: Any) -> int:
    """How many JSON objects ``value`` holds, itself included (counted without recursion: a schema may nest
    deeper than Python's stack)."""
    n, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            n += 1
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return n


_QUANTIFIER = re.compile(r"\{(\d+)(?:,\d*)?\}")
_GROUP_OPENING = re.compile(r"\((?:\?(?:P?<[^>]*>|[a-zA-Z-]*:?))?")


def largest_repetition(text: str, grammar: bool = False) -> int:
    """The most characters one counted repetition of ``text`` (a regex; ``grammar``: Lark/GBNF text, whose quoted
    strings are one item) spells out at its lower bound, counts multiplied through nesting (``(ab){3}`` 6,
    ``a{10}{10}`` 100). A character class, escape or literal character is one; a group of alternatives is as long
    as its longest (``(a|bc){3}`` 6); a group's length includes its own repetitions."""
    stack = [[0, 0, 0]]  # per open group: [this alternative's length so far, its last item's, the longest before]
    largest, i, n = 0, 0, len(text)
    while i < n:
        ch, top = text[i], stack[-1]
        if ch == "\\":
            j = i + 2
            if j < n and text[i + 1] in "pPxu" and text[j] == "{":
                j = text.find("}", j) + 1 or n
            item, i = 1, j
        elif ch == "[":
            j, depth = i + 1, 1
            j += j < n and text[j] == "^"
            j += j < n and text[j] == "]"
            while j < n and depth:
                depth += {"[": 1, "]": -1}.get(text[j], 0)
                j += 2 if text[j] == "\\" else 1
            item, i = 1, j
        elif grammar and ch == '"':
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 2 if text[j] == "\\" else 1
            item, i = max(1, j - i - 1), j + 1
        elif ch == "|":
            top[2], top[0], top[1] = max(top[2], top[0]), 0, 0
            i += 1
            continue
        elif ch == "(":
            stack.append([0, 0, 0])
            i = _GROUP_OPENING.match(text, i).end()  # type: ignore[union-attr] - "(" always matches
            continue
        elif ch == ")" and len(stack) > 1:
            closed = stack.pop()
            item, i = max(closed[0], closed[2]), i + 1
            top = stack[-1]
        elif ch == "{" and (m := _QUANTIFIER.match(text, i)):
            times = int(m.group(1))
            top[0] += top[1] * (times - 1)
            top[1] *= times
            largest = max(largest, top[1])
            i = m.end()
            continue
        else:
            item, i = 1, i + 1
        top[0] += item
        top[1] = item
    return largest


def _check_repetitions(text: str, param: str, grammar: bool = False) -> None:
    """A ConstraintError when a counted repetition of ``text`` spells out more than MAX_REPEATED_LENGTH
    characters: the grammar engine would compile it for seconds and slow every token of the batch."""
    if "{" in text and (most := largest_repetition(text, grammar)) > MAX_REPEATED_LENGTH:
        raise ConstraintError(f"{param}: a counted repetition spells out {most} characters, more than the "
                              f"{MAX_REPEATED_LENGTH} structured outputs allow; give smaller counts {{n}} (an "
                              "optional part {0,n} costs nothing) or a character class with *", param)


def _schema_entries(schema: Any) -> Iterator[tuple[str, Any]]:
    """Every (keyword, value) of ``schema`` and its subschemas, walked without recursion (schemas nest deep); a data
    keyword's value (``enum``, ``const``, ...) is yielded but not walked into."""
    for v in schema_nodes(schema):
        yield from v.items()


def _patterns(schema: Any) -> list[str]:
    """Every regex in ``schema``: ``pattern`` values and ``patternProperties`` names."""
    found: list[str] = []
    for k, s in _schema_entries(schema):
        if k == "pattern" and isinstance(s, str):
            found.append(s)
        elif k == "patternProperties" and isinstance(s, dict):
            found.extend(str(name) for name in s)
    return found


def _largest_enum(schema: Any) -> int:
    """The length of the longest ``enum`` list anywhere in ``schema``."""
    return max((len(s) for k, s in _schema_entries(schema) if k == "enum" and isinstance(s, list)), default=0)


_EXTRA_KEYS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
_OPEN_MEMBER_KEYS = _EXTRA_KEYS | {"allOf", "anyOf", "oneOf", "$ref"}  # a member whose keys this cannot list


def closed_objects(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever an object lists ``properties`` and says
    nothing about extra keys (OpenAI's strict mode; xgrammar's strict_mode in vLLM). Every output this
    allows is valid against the original; without it a small model keeps inventing keys.

    ``allOf`` members (inline or a local ``$ref``) describe one object together, as do an object's properties
    and its ``anyOf`` / ``oneOf`` branches: closing each alone would forbid the others' keys. So members are
    not closed, a branch is closed over its keys and its object's, and the object over all of them (left open
    when some member's or branch's keys cannot be listed)."""
    defs = _definitions(schema)
    refs: set[str] = set()
    _all_of_refs(schema, refs)
    members = {id(defs[r]) for r in refs if r in defs}  # $defs named as allOf members: closed with their siblings
    return _closed(schema, defs, members, member=False)


def _definitions(schema: Any) -> dict[str, Any]:
    """Every ``$defs`` / ``definitions`` entry by the pointer a local ``$ref`` names it with, wherever it sits: a
    tool's parameters under the ``required`` grammar keep theirs below the root (``rerooted``)."""
    out: dict[str, Any] = {}
    todo = [(schema, "#")]
    while todo:
        v, at = todo.pop()
        if isinstance(v, list):
            todo.extend((s, f"{at}/{i}") for i, s in enumerate(v))
        elif isinstance(v, dict):
            for k, s in v.items():
                if k in DATA_KEYS:
                    continue
                here = f"{at}/{_pointer_token(k)}"
                if k in ("$defs", "definitions") and isinstance(s, dict):
                    out.update((f"{here}/{_pointer_token(n)}", d) for n, d in s.items())
                todo.append((s, here))
    return out


def _pointer_token(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _all_of_refs(schema: Any, out: set[str]) -> None:
    if isinstance(schema, list):
        for s in schema:
            _all_of_refs(s, out)
    elif isinstance(schema, dict):
        for k, v in schema.items():
            if k == "allOf" and isinstance(v, list):
                out.update(m["$ref"] for m in v if isinstance(m, dict) and isinstance(m.get("$ref"), str))
            if k not in DATA_KEYS:
                _all_of_refs(v, out)


def _closed(schema: Any, defs: dict[str, Any], members: set[int], member: bool, siblings: tuple = ()) -> Any:
    """``member``: an allOf member (closed by the object holding it); ``siblings``: the properties of the object
    whose anyOf / oneOf branch this is (the branch's keys as far as closing it goes)."""
    if isinstance(schema, list):
        return [_closed(s, defs, members, False) for s in schema]
    if not isinstance(schema, dict):
        return schema
    props = schema.get("properties")
    props = props if isinstance(props, dict) else None
    branch_of = tuple(props) if props is not None and not _EXTRA_KEYS & schema.keys() else ()
    out = {}
    for k, v in schema.items():
        if k in DATA_KEYS:
            out[k] = v
        elif k == "allOf" and isinstance(v, list):
            out[k] = [_closed(s, defs, members, True) for s in v]
        elif k in ("anyOf", "oneOf") and isinstance(v, list) and branch_of:
            out[k] = [_closed(s, defs, members, False, branch_of) for s in v]
        elif k in ("$defs", "definitions") and isinstance(v, dict):
            out[k] = {n: _closed(d, defs, members, id(d) in members) for n, d in v.items()}
        else:
            out[k] = _closed(v, defs, members, False)
    if member or _EXTRA_KEYS & out.keys():
        return out
    # the keys this object may have: its own, its siblings' (as a branch), its allOf members' and (when it
    # lists properties) its anyOf / oneOf branches'
    parts = [*(out.get("allOf") or []), *((out.get("anyOf") or []) + (out.get("oneOf") or []) if branch_of else [])]
    # a member that is only a $ref is the definition it names (pydantic before 2.9 wraps a described model so)
    parts = [defs.get(p.get("$ref")) if isinstance(p, dict) and set(p) == {"$ref"} else p for p in parts]
    if props is None and not any(isinstance(p, dict) and "properties" in p for p in parts):
        return out
    # ... and the keys ``required`` names, listed in ``properties`` or not (a loose schema's: closing over the
    # properties alone made them impossible)
    names = dict.fromkeys([*(props or {}), *siblings, *_required(schema)])
    for p in parts:
        if not isinstance(p, dict) or _OPEN_MEMBER_KEYS & p.keys() or not isinstance(p.get("properties", {}), dict):
            return out
        names.update(dict.fromkeys([*p.get("properties", {}), *_required(p)]))
    own = out.get("properties") if isinstance(out.get("properties"), dict) else {}
    out["properties"] = {**own, **{n: {} for n in names if n not in own}}
    out["additionalProperties"] = False
    return out


def _required(schema: dict[str, Any]) -> list[str]:
    r = schema.get("required")
    return [n for n in r if isinstance(n, str)] if isinstance(r, list) else []


_WHAT = {ConstraintKind.JSON_OBJECT: "JSON object", ConstraintKind.JSON_SCHEMA: "JSON schema",
         ConstraintKind.REGEX: "regular expression", ConstraintKind.CHOICE: "choice",
         ConstraintKind.GRAMMAR: "grammar"}


def _first_line(msg: str) -> str:
    """llguidance's message on one line: its first line plus the ``error:`` line of a regex parse error
    (the source excerpt and caret lines between them are dropped)."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    if not lines:
        return "rejected"
    cause = [ln for ln in lines[1:] if ln.startswith("error:")]
    return " ".join([lines[0].removesuffix(":"), *cause[:1]])


def _schema_advice(reason: str) -> str:
    """The engine's refusal of a JSON schema with what to do where the engine's own text names an option clients
    cannot set (``coerce_one_of``)."""
    if "coerce_one_of" in reason:
        return ("oneOf whose branches can match the same value cannot be enforced exactly (one and only one branch); "
                "write it as anyOf, or make the branches disjoint (e.g. a 'const' discriminator property in each)")
    return reason


@dataclass
class CompileStats:
    compiled: int = 0  # distinct constraints compiled
    hits: int = 0  # matchers made from the cache
    compile_s: float = 0.0  # total seconds spent compiling (refusals included)
    refused: int = 0  # distinct constraints the compile refused
    refusal_hits: int = 0  # refusals answered from the cache


PAD_TOKEN = "<|lineside_padding_{}|>"  # the name a padding id is given in the grammar engine's tokenizer


def padded_tokenizer_json(tokenizer_json: str, vocab_size: int) -> tuple[str, int]:
    """(tokenizer.json with every id from the tokenizer's end to ``vocab_size`` added as a special token, the
    tokenizer's own size): what llguidance needs to take an EOS id past the tokenizer. vLLM pads its llguidance
    tokenizer to the model's vocabulary too (n_vocab; xgrammar's TokenizerInfo vocab_size) but with nameless
    tokens, which cannot be EOS ids: llguidance checks those against the tokenizer before it pads."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True).values()
    size = max(ids) + 1 if ids else 0
    if size > vocab_size:
        raise LinesideError(f"the tokenizer has ids up to {size - 1} but the model's vocabulary only {vocab_size} "
                            "rows: the bundle's tokenizer is not this model's; rebuild it from the checkpoint")
    if size == vocab_size:
        return tokenizer_json, size
    spec = json.loads(tokenizer_json)
    spec["added_tokens"] = [*(spec.get("added_tokens") or []), *(
        {"id": i, "content": PAD_TOKEN.format(i), "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for i in range(size, vocab_size))]
    return json.dumps(spec, ensure_ascii=False), size


@dataclass(frozen=True)
class PaddingMask:
    """Keeps a grammar's mask off the model's padding ids (past the tokenizer), except EOS ids among them: the
    bits from word ``first_word`` on are ANDed with ``keep``."""

    first_word: int
    keep: np.ndarray

    @classmethod
    def of(cls, tokenizer_size: int, vocab_size: int, eos_ids: Iterable[int]) -> PaddingMask | None:
        if tokenizer_size >= vocab_size:
            return None
        first = tokenizer_size // 32
        ok = np.zeros(((vocab_size + 31) // 32 - first) * 32, dtype=bool)
        ok[:tokenizer_size - first * 32] = True
        for e in eos_ids:
            if tokenizer_size <= e < vocab_size:
                ok[e - first * 32] = True
        return cls(first, np.packbits(ok, bitorder="little").view(np.int32))

    def clear(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row, self.first_word:] &= self.keep


class GrammarMatcher:
    """One request's position in its grammar: the next-token mask, advanced by each sampled token.

    ``after``: a token id the grammar waits for (a reasoning model's ``</think>``): until it is sampled the
    output is free (no mask; ``active`` False), and the grammar starts with the token after it, as vLLM applies a
    structured output to the answer of a reasoning model only."""

    def __init__(self, matcher: Any, vocab_size: int, padding: PaddingMask | None = None, after: int | None = None,
                 constraint: Constraint | None = None):
        self._m = matcher
        self.constraint = constraint  # what it enforces: a rejection's message names its field (grammar_failure.py)
        self.vocab_size = vocab_size
        self.padding = padding
        self.after = after
        self.active = after is None
        self._taken = 0  # tokens the grammar accepted since it started: a rollback past them waits again

    def fill_mask(self, bitmask: np.ndarray, row: int = 0) -> None:
        """Write this matcher's allowed-token bits into ``bitmask[row]`` (int32, 32 tokens per word)."""
        if not self.active:
            bitmask[row] = -1
            return
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.ctypes.data, v.size * v.itemsize)
        if self.padding is not None:
            self.padding.clear(bitmask, row)

    def allowed(self) -> np.ndarray | None:
        """The mask as bools over the vocabulary (one row; the batched path is ``fill_masks``); None while the
        grammar waits for its ``after`` token (every token allowed)."""
        if not self.active:
            return None
        bm = new_bitmask(1, self.vocab_size)
        self.fill_mask(bm, 0)
        return unpack_bitmask(bm, self.vocab_size)[0]

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar forbids it (the matcher is then in error)."""
        if not self.active:
            self.active = int(token) == self.after
            return True
        ok = bool(self._m.consume_token(int(token)))
        self._taken += ok
        return ok

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative proposals the target rejected)."""
        inside = min(n, self._taken)
        if inside and not self._m.rollback(inside):
            raise LinesideError(f"grammar matcher could not roll back {inside} tokens: {_first_line(self._m.get_error())}")
        self._taken -= inside
        if n > inside:  # back past the ``after`` token: waiting for it again
            self.active = False

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a proposal) the grammar accepts in a row, without advancing."""
        tokens = [int(t) for t in tokens]
        if self.active:
            return int(self._m.validate_tokens(tokens))
        if self.after not in tokens:
            return len(tokens)
        start = tokens.index(self.after) + 1
        return start + int(self._m.validate_tokens(tokens[start:])) if start < len(tokens) else start

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more than ending: the request stops here."""
        return self.active and bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return self.active and bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        """llguidance's reason, its first line: the rest is a dump of its parser state and the whole grammar
        (verbose errors), which reached clients in the request's error message."""
        return _first_line(self._m.get_error()) if self._m.is_error() else None


# Compiled grammars kept per engine (serve --max-cached-grammars): each holds its lexer and parser tables, which grow
# with the schema and the vocabulary (SmolLM2's 49k tokens: ~0.13 MB for a 3-property object, ~0.3 MB for 50,
# ~2 MB for 400), so the count is what bounds their memory.
DEFAULT_CACHED_GRAMMARS = 64


class GrammarCompiler:
    """Compiles constraints for one tokenizer and keeps the results (LRU): a repeat pays a copy."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int],
                 max_entries: int = DEFAULT_CACHED_GRAMMARS):
        if max_entries < 1:  # a request compiles its grammar when checked, then takes a matcher from the cache
            raise LinesideError(f"the grammar cache holds >= 1 grammar, got {max_entries}")
        try:
            import llguidance
        except ImportError:  # pragma: no cover - a runtime dependency
            raise LinesideError("constrained decoding needs llguidance: pip install llguidance") from None
        self._ll = llguidance
        eos = sorted({int(e) for e in eos_ids if 0 <= int(e) < vocab_size})
        if not eos:
            raise LinesideError("constrained decoding needs the model's end-of-sequence token id; the bundle has none")
        self.vocab_size = int(vocab_size)
        self.eos_ids = eos
        # The model's vocabulary may outnumber the tokenizer's (padding rows in the embedding, as Qwen2's 151936
        # for 151665 tokens), and an EOS id from generation_config may lie among them: llguidance checks EOS ids
        # against the tokenizer before it pads to n_vocab, so the padding ids are named here as special tokens.
        tokenizer_json, self.tokenizer_size = padded_tokenizer_json(readable_tokenizer_json(tokenizer_json),
                                                                    self.vocab_size)
        self.padding = PaddingMask.of(self.tokenizer_size, self.vocab_size, eos)
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
        except ValueError as e:  # a decoder it cannot read (WordPiece, none): every request using it was a 500
            raise LinesideError(f"structured outputs and logprobs cannot read this model's tokenizer "
                                f"({_first_line(str(e))}); they need a byte-level BPE or SentencePiece tokenizer.json"
                                ) from None
        # the token of each byte that has one alone (byte-level BPE: all but a few invalid UTF-8 bytes), by byte
        self._byte_tokens = [t[0] for b in range(256) if len(t := self.tokenizer.tokenize_bytes(bytes([b]))) == 1
                             and bytes(self.tokenizer.decode_bytes(t)) == bytes([b])]
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        # refused constraints → their reason without the field: a refusal took up to seconds of compile, which one
        # client repeating it could otherwise make a worker spend again and again (LRU, as many as compiled ones)
        self._refused: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.stats = CompileStats()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int],
                      max_entries: int = DEFAULT_CACHED_GRAMMARS) -> GrammarCompiler:
        """From lineside's ``Tokenizer`` (its tokenizer.json as the ``tokenizers`` library serializes it)."""
        return cls(tokenizer._tok.to_str(), vocab_size, eos_ids, max_entries)

    @property
    def cached(self) -> int:
        """Compiled grammars held (at most ``max_entries``)."""
        return len(self._cache)

    def token_bytes(self, token: int) -> bytes:
        """A token's raw bytes (what logprobs report as ``bytes``): the tokenizer's view the grammar also uses; a
        padding id past the tokenizer has none."""
        if int(token) >= self.tokenizer_size:
            return b""
        return bytes(self.tokenizer.decode_bytes([int(token)]))

    def compile(self, constraint: Constraint) -> None:
        """Check and cache ``constraint`` (raises ConstraintError naming its field); a no-op when cached."""
        self._template(constraint)

    def matcher(self, constraint: Constraint, after: int | None = None) -> GrammarMatcher:
        """A fresh matcher at the start of ``constraint``'s grammar (``after``: which starts after that token)."""
        return GrammarMatcher(self._template(constraint).deep_copy(), self.vocab_size, self.padding, after,
                              constraint)

    def _template(self, c: Constraint) -> Any:
        where = c.param or c.kind.value
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                self.stats.hits += 1
                return hit
            refusal = self._refused.get(c)
            if refusal is not None:  # the same refusal, named after this request's field
                self._refused.move_to_end(c)
                self.stats.refusal_hits += 1
                raise ConstraintError(f"{where}: {refusal}", c.param)
        t0 = time.perf_counter()
        try:
            m = self._build(c)
        except ConstraintError as e:
            with self._lock:
                self.stats.refused += 1
                self.stats.compile_s += time.perf_counter() - t0
                self._refused[c] = str(e).removeprefix(f"{where}: ")
                while len(self._refused) > self.max_entries:
                    self._refused.popitem(last=False)
            raise
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_s += time.perf_counter() - t0
            self._cache[c] = m
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return m

    def _build(self, c: Constraint) -> Any:
        return _on_large_stack(lambda: self._build_here(c))

    def _build_here(self, c: Constraint) -> Any:
        where = c.param or c.kind.value
        grammar = c.llguidance_grammar()
        m = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            reason = _first_line(m.get_error())
            advice = _schema_advice(reason) if c.kind == ConstraintKind.JSON_SCHEMA else reason
            # a schema the engine cannot enforce is no invalid one: say what to change instead
            raise ConstraintError(f"{where}: " + (advice if advice != reason else f"invalid {_WHAT[c.kind]}: {reason}"),
                                  c.param)
        # Satisfiable at all? The first mask allows some token (EOS when only the empty string matches).
        bm = new_bitmask(1, self.vocab_size)
        m.unsafe_compute_mask_ptr(bm[0].ctypes.data, bm[0].size * 4)
        if self.padding is not None:
            self.padding.clear(bm, 0)
        if not m.is_error() and bm.any() and not _takes_one(m, bm):
            raise ConstraintError(f"{where}: this {_WHAT[c.kind]} starts with text this model's vocabulary has no "
                                  "tokens for (a character with no piece and no byte fallback); leave it out", c.param)
        if not m.is_error() and bm.any() and (dead := self._forced_dead_end(m)) is not None:
            raise ConstraintError(dead_end_message(c, dead), c.param)
        if m.is_error() or not bm.any():
            why = f": {_first_line(m.get_error())}" if m.is_error() else ""
            raise ConstraintError(f"{where}: this {_WHAT[c.kind]} can never be matched by any text{why}", c.param)
        self._probe(m, c)
        return m

    def _forced_dead_end(self, m: Any) -> str | None:
        """Follow the text every output must write (masks of one token, on a copy, at most FORCED_STEPS): the grammar
        engine's error where that text reaches a character the vocabulary cannot spell (``ok!`` without a "!"
        piece or byte pieces), so the request is a 400 before generating; None when the path branches first."""
        w, bm = m.deep_copy(), new_bitmask(1, self.vocab_size)
        for _ in range(FORCED_STEPS):
            w.unsafe_compute_mask_ptr(bm[0].ctypes.data, bm[0].size * 4)
            ids = np.flatnonzero(unpack_bitmask(bm, self.vocab_size)[0])
            if w.is_error() or len(ids) != 1 or int(ids[0]) in self.eos_ids:
                return None
            if not w.consume_token(int(ids[0])):
                why = _first_line(w.get_error())
                return why if is_dead_end(why) else None
        return None

    def _probe(self, m: Any, c: Constraint) -> None:
        """Walk PROBE_TOKENS one-byte tokens on copies of ``m`` (the lowest, then the highest byte the grammar takes
        at each step): a limit the grammar engine hits only once generating (a huge counted repetition) is a
        ConstraintError naming it here, not an engine error at the first token. Bytes, not masks: a mask over a
        large vocabulary costs milliseconds in free text, a rejected byte microseconds."""
        bm = new_bitmask(1, self.vocab_size)
        for order in (self._byte_tokens, self._byte_tokens[::-1]):
            w = m.deep_copy()
            for _ in range(PROBE_TOKENS):
                if w.is_stopped() or not any(w.try_consume_tokens([t]) for t in order if not w.is_error()):
                    break
                if order is self._byte_tokens:  # a lexeme's later states are built for masks (precomputed)
                    w.unsafe_compute_mask_ptr(bm[0].ctypes.data, bm[0].size * 4)
            if w.is_error():
                raise ConstraintError(limit_message(c, _first_line(w.get_error())), c.param)


def _takes_one(m: Any, bm: np.ndarray) -> bool:
    """Whether the grammar takes one of the first mask's few tokens: where the vocabulary cannot spell the text the
    grammar forces ("!" with no piece and no byte fallback), llguidance's mask holds the tokenizer's encoding of it,
    <unk>, which it then rejects (a request failing at its first token). A mask of many tokens is taken as it is."""
    ids = np.flatnonzero(unpack_bitmask(bm, bm.shape[1] * 32)[0])
    return len(ids) > 8 or any(m.validate_tokens([int(t)]) for t in ids)


def is_limit_error(why: str | None) -> bool:
    """Whether a grammar engine error (one line) is one of its limits (LIMIT_ERRORS), not a grammar it rejects."""
    return why is not None and any(m in why for m in LIMIT_ERRORS)


# llguidance's text when a grammar forces bytes the vocabulary cannot spell: the mask then held the tokenizer's
# encoding of them (<unk> on a SentencePiece vocabulary without byte pieces), which decodes to other bytes
_FORCED_BYTES = re.compile(r"forced bytes: got '(.*)'; applying")


def is_dead_end(why: str | None) -> bool:
    """Whether a grammar engine error (one line) means the vocabulary cannot spell what the grammar needs next: the
    request's grammar at a dead end with this model, not the engine failing."""
    return why is not None and _FORCED_BYTES.search(why) is not None


def dead_end_message(c: Constraint, why: str) -> str:
    """The one line a request ends with when its grammar needs text no token of this vocabulary spells."""
    found = _FORCED_BYTES.search(why)
    needed = f" ({found.group(1)!r} next)" if found else ""
    return (f"{c.param or c.kind.value}: this {_WHAT[c.kind]} cannot be completed with this model's vocabulary: it "
            f"needs text no token spells{needed} (a character with no piece and no byte fallback); leave that text out")


def limit_message(c: Constraint, why: str) -> str:
    """The one line a grammar past the engine's limits is refused with, at compile or mid-generation: the field,
    the engine's reason, what to send instead."""
    return (f"{c.param or c.kind.value}: this {_WHAT[c.kind]} is past the grammar engine's limits once generating "
            f"({why}); give a smaller one (fewer choices, smaller repetition counts {{n}} and lengths)")


_stack_size_lock = threading.Lock()


def _on_large_stack(fn: Any) -> Any:
    """``fn()`` on a fresh thread with COMPILE_STACK_BYTES of stack (its result or its exception)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    with _stack_size_lock:  # the size applies to threads started while it is set: only this one
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="lineside-grammar", daemon=True)
            t.start()
        finally:
            threading.stack_size(previous)
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


_executor: Any = None
_executor_lock = threading.Lock()


def fill_masks(rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """Every constrained row's mask into ``bitmask`` (rows not listed, and rows whose grammar has not started,
    keep theirs) at once: llguidance's thread pool, GIL released; one row is computed inline."""
    global _executor
    rows = [(m, r) for m, r in rows if m.active]
    if not rows:
        return
    if len(rows) == 1:
        rows[0][0].fill_mask(bitmask, rows[0][1])
        return
    assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._m, r) for m, r in rows], bitmask.ctypes.data,
                                      bitmask.shape[1] * 4, bitmask.shape[0])
    for m, r in rows:
        if m.padding is not None:
            m.padding.clear(bitmask, r)


def new_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A packed mask, every token allowed: int32 ``[rows, ceil(vocab / 32)]``, bit i of word w = token 32w + i."""
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool ``[rows, vocab]``: True where a token is allowed (little-endian words, low bit first)."""
    return np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size] \
        .astype(bool)
