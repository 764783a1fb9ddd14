"""The engine protocol the server depends on: LLMEngine offers every member, and the server reaches for no
member of its engine that the protocol does not declare (read from the server's source)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from lineside.runtime.serving import AdapterServing, ReportsFailure, ServingEngine, serves_adapters

SERVER = Path(__file__).resolve().parents[2] / "lineside" / "server"


def _members() -> set[str]:
    """ServingEngine's members and those of its optional extensions AdapterServing (the runtime LoRA routes) and
    ReportsFailure (/health of an engine that failed)."""
    out: set[str] = set()
    for proto in (ServingEngine, AdapterServing, ReportsFailure):
        out |= set(inspect.get_annotations(proto))
        out |= {n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")}
    return out


def _engine_uses() -> dict[str, str]:
    """Every ``<x>.engine.<name>``, ``engine.<name>`` (a route's chosen engine) and ``getattr(..engine, "<name>")``
    in lineside/server and its subpackages: name → file."""
    out: dict[str, str] = {}
    for path in sorted(SERVER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            target = name = None
            if isinstance(node, ast.Attribute):
                target, name = node.value, node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                target, name = node.args[0], node.args[1].value
            if (isinstance(target, ast.Attribute) and target.attr == "engine") or (
                    isinstance(target, ast.Name) and target.id in ("engine", "fallback_engine")):
                out.setdefault(str(name), path.name)
    return out


def test_the_server_uses_only_what_the_protocol_declares():
    uses = _engine_uses()
    assert {"submit", "tokenizer", "stats", "start", "stop"} <= set(uses)  # the scan sees the server's calls
    undeclared = {n: f for n, f in uses.items() if n not in _members()}
    assert not undeclared, f"the server uses engine members ServingEngine does not declare: {undeclared}"


def test_llm_engine_is_a_serving_engine(tiny_bundle):
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(tiny_bundle)
    eng = LLMEngine(b, backend=OnnxRuntimeBackend(b, num_slots=1, threads=1), num_slots=1)
    try:
        assert isinstance(eng, ServingEngine) and isinstance(eng, AdapterServing) and isinstance(eng, ReportsFailure)
        assert serves_adapters(eng) and not serves_adapters(object())  # the routes' check, which runs no property
        assert not [m for m in _members() if not hasattr(eng, m)]
    finally:
        eng.close()
