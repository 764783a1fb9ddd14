"""The tree's imports run one way (DESIGN.md): the runtime never imports the build side, nothing
imports the server or the CLI, and the subpackages form no cycle. Lazy imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lineside"
ENTRY = {"cli", "__main__"}  # may import everything
HARNESS = {"bench"}  # the load generator may run the server in-process, as the CLI does


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every lineside module this file imports, at any depth of the file (relative imports resolved)."""
    me = _module_name(path).split(".")
    if path.name != "__init__.py":
        me = me[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "lineside")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(me[: len(me) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "lineside":
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _unit(module: str) -> str:
    """The part of the tree a module belongs to: a subpackage (build, runtime, ...) or 'core' / an entry."""
    parts = module.split(".")
    if len(parts) == 1:
        return "core"
    head = parts[1]
    if (PACKAGE / head).is_dir():
        return head
    return head if head in ENTRY else "core"


def _graph() -> dict[str, set[tuple[str, str]]]:
    edges: dict[str, set[tuple[str, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _module_name(path)
        for target in _imports(path):
            edges.setdefault(src, set()).add((target, f"{path.relative_to(PACKAGE.parent)}"))
    return edges


def test_the_walk_sees_imports():
    """The checker itself must find the imports it is meant to police (so the rules below can fail)."""
    edges = _graph()
    assert ("lineside.runtime.tensorrt.key", "lineside/build/tensorrt/builder.py") in {
        (t, f) for t, f in edges["lineside.build.tensorrt.builder"]}
    assert any(t.startswith("lineside.server") for t, _ in edges["lineside.cli"] | edges.get("lineside.server.commands", set()))


def test_runtime_never_imports_build():
    bad = sorted(f"{f} imports {t}" for src, ts in _graph().items() if _unit(src) == "runtime"
                 for t, f in ts if _unit(t) == "build")
    assert not bad, "the runtime must stand alone on the device:\n" + "\n".join(bad)


@pytest.mark.parametrize("protected", ["server", "cli"])
def test_nothing_imports_server_or_cli(protected):
    allowed = {protected, *ENTRY, *(HARNESS if protected == "server" else ())}
    bad = sorted(f"{f} imports {t}" for src, ts in _graph().items() if _unit(src) not in allowed
                 for t, f in ts if _unit(t) == protected)
    assert not bad, "\n".join(bad)


def test_no_cycle_between_subpackages():
    deps: dict[str, dict[str, str]] = {}
    for src, ts in _graph().items():
        for t, f in ts:
            a, b = _unit(src), _unit(t)
            if a != b:
                deps.setdefault(a, {}).setdefault(b, f"{f} imports {t}")
    # depth-first search for a cycle; report one with the file that closes each edge
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in deps.get(u, {}):
            if state.get(v) == 1:
                loop = stack[stack.index(v):] + [v]
                return [deps[x][y] for x, y in zip(loop, loop[1:], strict=False)]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(deps):
        if u not in state and (cycle := visit(u)):
            pytest.fail("import cycle between subpackages:\n" + "\n".join(cycle))
