"""Run the real command line (a child `python -m lineside`) and check what a user sees when it fails."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import typer

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lineside", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str, code: int | None = None) -> str:
    """Non-zero exit (``code`` if given), exactly one non-empty line on stderr, no traceback, no rich box."""
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    if code is not None:
        assert proc.returncode == code, (proc.returncode, proc.stderr)
    err = proc.stderr.strip()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "╭" not in err and "INFO" not in err, err
    for n in needles:
        assert n.lower() in err.lower(), (n, err)
    return lines[0]


def tree_snapshot(root: Path) -> set[str]:
    """Every path under root (hidden ones and *.partial included), to show a failed command wrote nothing."""
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def all_commands(app: typer.Typer) -> dict[str, typing.Any]:
    """'build', 'jetson plan', ... → the click command typer made (leaves of the tree only)."""
    out: dict[str, typing.Any] = {}

    def walk(cmd, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out[" ".join(path)] = cmd

    walk(typer.main.get_command(app), [])
    return out


def base_type(param) -> type | None:
    """The Python type a typer parameter was annotated with (Optional unwrapped)."""
    ann = param.type_descriptor.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    return args[0] if typing.get_origin(ann) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
        and len(args) == 1 else ann


def lineside_app() -> typer.Typer:
    from lineside.cli import _register, app

    if not getattr(app, "_registered_for_tests", False):
        _register()
        app._registered_for_tests = True
    return app
