"""Request fields → the typed output constraint: OpenAI's ``response_format`` and vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (and their newer ``structured_outputs`` object).

At most one may be given; each bad one is a 400 naming its field. ``checked`` compiles the constraint
(cached per schema by the engine's grammar compiler), so a schema that can never match is refused
before anything is queued.
"""

from __future__ import annotations

from typing import Any

from lineside.runtime.structured import Constraint, ConstraintError, GrammarCompiler
from lineside.server.errors import APIError


def _json_schema(schema: Any, param: str) -> Constraint:
    """A JSON-schema constraint, with the formats the grammar engine cannot enforce left out (annotations)."""
    return Constraint.json_schema(schema, param=param)


_GUIDED = (("guided_json", _json_schema), ("guided_regex", Constraint.regex),
           ("guided_choice", Constraint.choice), ("guided_grammar", Constraint.grammar))
_STRUCTURED = (("json", _json_schema), ("regex", Constraint.regex), ("choice", Constraint.choice),
               ("grammar", Constraint.grammar))
# vLLM's StructuredOutputsParams options that change nothing here: JSON is always written without free whitespace
# and objects are closed (xgrammar's and llguidance's whitespace_pattern is ignored by vLLM too)
_STRUCTURED_OPTIONS = frozenset({"json_object", "disable_fallback", "disable_any_whitespace",
                                 "disable_additional_properties", "whitespace_pattern"})


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_value", param=param)


def response_format_constraint(rf: Any) -> Constraint | None:
    """OpenAI ``response_format``: text (none), json_object, json_schema."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad("response_format: must be an object such as {\"type\": \"json_object\"}", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object("response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema: give {\"name\": ..., \"schema\": {...}}", "response_format.json_schema")
        if "schema" not in js:
            raise _bad("response_format.json_schema.schema: missing; give the JSON schema the output must follow",
                       "response_format.json_schema.schema")
        return _json_schema(js["schema"], param="response_format.json_schema.schema")
    raise _bad(f"response_format.type: {kind!r} is not text, json_object or json_schema", "response_format.type")


def request_constraint(req: Any) -> Constraint | None:
    """The one constraint a chat or completion request asks for (None: free text)."""
    found: list[Constraint] = []
    try:
        c = response_format_constraint(getattr(req, "response_format", None))
        if c is not None:
            found.append(c)
        for name, make in _GUIDED:
            v = getattr(req, name, None)
            if v is not None:
                found.append(make(v, param=name))
        so = getattr(req, "structured_outputs", None)
        if so is not None:
            if not isinstance(so, dict):
                raise _bad("structured_outputs: must be an object such as {\"json\": {...}}", "structured_outputs")
            for key in so:  # vLLM refuses a key it lacks; dropped, a misspelt one left the answer unconstrained
                if key not in _STRUCTURED_OPTIONS and key not in dict(_STRUCTURED):
                    what = ("structural tags are not supported" if key == "structural_tag" else
                            "not a structured_outputs field")
                    raise _bad(f"structured_outputs.{key}: {what}; give one of json, regex, choice, grammar or "
                               "json_object", f"structured_outputs.{key}")
            for name, make in _STRUCTURED:
                if so.get(name) is not None:
                    found.append(make(so[name], param=f"structured_outputs.{name}"))
            if so.get("json_object"):
                found.append(Constraint.json_object("structured_outputs.json_object"))
    except ConstraintError as e:
        raise _bad(str(e), e.param or "response_format") from None
    if len(found) > 1:
        raise _bad(f"{found[1].param}: only one output constraint per request; {found[0].param} is already given",
                   found[1].param)
    return found[0] if found else None


def checked(compiler: GrammarCompiler, c: Constraint | None) -> Constraint | None:
    """Compile (or find cached) ``c``; a 400 naming its field when it is invalid or can never match."""
    if c is not None:
        try:
            compiler.compile(c)
        except ConstraintError as e:
            raise _bad(str(e), e.param or c.param) from None
    return c
