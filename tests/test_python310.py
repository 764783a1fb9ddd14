"""lineside runs on Python 3.10 (pyproject's requires-python; JetPack 6's Python on the Jetsons it serves from):
no module may import what only a later standard library has. CI runs 3.11, where such an import works, so the
sources are read instead: an import from this table (or an attribute use like ``enum.StrEnum``) outside a
``try`` or a ``sys.version_info`` check fails here, naming the file, line and the 3.10 way to write it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lineside"

# stdlib names added after 3.10 -> what to use instead
LATER = {
    ("enum", "StrEnum"): "lineside.strenum.StrEnum",
    ("enum", "ReprEnum"): "str/int mixins",
    ("typing", "Self"): "a TypeVar or the class name in quotes",
    ("typing", "LiteralString"): "str",
    ("typing", "Never"): "typing.NoReturn",
    ("typing", "assert_never"): "an explicit raise",
    ("typing", "NotRequired"): "total=False TypedDicts",
    ("typing", "Required"): "total=False TypedDicts",
    ("typing", "override"): "nothing (3.12)",
    ("datetime", "UTC"): "datetime.timezone.utc",
    ("asyncio", "TaskGroup"): "asyncio.gather",
    ("asyncio", "timeout"): "asyncio.wait_for",
    ("hashlib", "file_digest"): "a read loop",
    ("itertools", "batched"): "a slice loop (3.12)",
    ("contextlib", "chdir"): "os.chdir in try/finally",
}


def _guarded_lines(tree: ast.AST) -> set[int]:
    """Lines inside a ``try`` body or an ``if`` on ``sys.version_info`` (a fallback is written there)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) or (isinstance(node, ast.If) and "version_info" in ast.unparse(node.test)):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _later_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    guarded = _guarded_lines(tree)
    aliases = {}  # local name -> stdlib module (import datetime as dt)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names})
            if any(a.name == "tomllib" for a in node.names) and node.lineno not in guarded:
                found.append(f"{node.lineno}: import tomllib (3.11; try it, fall back to tomli)")
        elif isinstance(node, ast.ImportFrom) and node.module and node.lineno not in guarded:
            found += [f"{node.lineno}: from {node.module} import {a.name} (3.10: {LATER[node.module, a.name]})"
                      for a in node.names if (node.module, a.name) in LATER]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.lineno not in guarded:
            key = (aliases.get(node.value.id, ""), node.attr)
            if key in LATER:
                found.append(f"{node.lineno}: {node.value.id}.{node.attr} (3.10: {LATER[key]})")
    return [f"{path.relative_to(PACKAGE.parent)}:{f}" for f in found]


def test_no_module_needs_a_later_python_than_3_10():
    found = [use for path in sorted(PACKAGE.rglob("*.py")) for use in _later_uses(path)]
    assert not found, "\n".join(found)
