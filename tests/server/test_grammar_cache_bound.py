"""The structured-output grammar cache is bounded by `serve --max-cached-grammars`: a client sending a new schema with
every request (a schema per form, tools that change) cannot grow the server without end. Each compiled grammar
holds its lexer and parser tables (SmolLM2: ~0.1 MB for a small object, ~2 MB for 400 properties), so a count of
them is what the bound is; /metrics shows it and the misses."""

from __future__ import annotations

import inspect

import httpx
import pytest

from lineside.runtime.structured import DEFAULT_CACHED_GRAMMARS
from tests.server.conftest import metric, running_server


def _schema(i: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}


def _ask(url: str, i: int) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _schema(i)}}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_distinct_schemas_keep_at_most_the_bound(tiny_bundle):
    with running_server(tiny_bundle, num_slots=2, threads=1, max_cached_grammars=3) as srv:
        for i in range(8):
            _ask(srv.url, i)
        text = httpx.get(srv.url + "/metrics").text
        assert srv.state.engine.grammar.cached == 3
        assert metric(text, "lineside_grammar_cache_entries") == 3
        assert metric(text, "lineside_grammar_compiles_total") == 8
        _ask(srv.url, 7)  # among the 3 most recent: a hit, nothing compiled
        _ask(srv.url, 0)  # dropped long ago: compiled again, and still 3 held
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "lineside_grammar_compiles_total") == 9
        assert metric(text, "lineside_grammar_cache_entries") == 3


@pytest.mark.parametrize("bound", [0, -1])
def test_a_bound_below_one_is_refused(tiny_bundle, bound):
    """A request's grammar is compiled when it is checked and its matcher taken from the cache at submit: with no
    room for one it would be compiled twice."""
    from lineside.errors import LinesideError
    from tests.server.conftest import make_engine

    with pytest.raises(LinesideError, match="max_cached_grammars"):
        make_engine(tiny_bundle, max_cached_grammars=bound)


def test_serve_default_is_the_engines():
    from lineside.server.app import create_app
    from lineside.server.commands import serve

    assert inspect.signature(serve).parameters["max_cached_grammars"].default == DEFAULT_CACHED_GRAMMARS
    assert inspect.signature(create_app).parameters["max_cached_grammars"].default == DEFAULT_CACHED_GRAMMARS
