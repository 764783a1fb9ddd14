"""Run the real command line (a child `python -m lineside`) and check what a user sees when it fails."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import typer

from tests.cli import cli_zygote

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str | Path, timeout: float | None = 120, env: dict[str, str] | None = None,
            cwd: str | Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m lineside ARGS` as subprocess.run(capture_output=True, text=True) gives it: a process of its
    own, forked from a zygote that imported lineside.cli and its command modules once (tests/cli/cli_zygote.py),
    or a fresh interpreter when the zygote cannot stand for one (an environment other than the one it imported
    under; ``fresh``: always, for the tests of a real start; LINESIDE_TESTS_FRESH_CLI=1: for every call)."""
    argv = [str(a) for a in args]
    run_env = dict(os.environ if env is None else env)
    run_cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    if not fresh and os.environ.get("LINESIDE_TESTS_FRESH_CLI", "") in ("", "0"):
        zygote = cli_zygote.shared()
        if zygote.usable_for(run_env) and zygote.lock.acquire(blocking=False):
            try:
                return zygote.run(argv, env=run_env, cwd=run_cwd, timeout=timeout)
            finally:
                zygote.lock.release()
    return subprocess.run([sys.executable, "-m", "lineside", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


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


def unreadable_dirs(root: Path) -> dict[str, Path]:
    """Paths the OS refuses to look up, made under ``root``: a name past NAME_MAX ("too long"), a symlink that
    points at itself ("loop"), and a real directory so deep that its files' paths pass PATH_MAX ("deep": the
    directory itself can be looked up, ``deep/adapter_config.json`` cannot)."""
    loop = root / "loop"
    loop.symlink_to(loop)
    deep = str(root)
    while len(deep) < 4080:  # the directory under PATH_MAX (4096 with its NUL), "/adapter_config.json" past it
        deep += "/" + "d" * min(200, max(1, 4080 - len(deep) - 1))
    Path(deep).mkdir(parents=True)
    return {"too long": root / ("a" * 300), "loop": loop / "adapter", "deep": Path(deep)}
