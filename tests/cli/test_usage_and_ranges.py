"""Usage errors and numeric ranges, for every command and every numeric option there is (found by walking
the command tree, so a new command or option is covered without touching this file): one line on stderr
naming what is wrong and `lineside CMD --help`, exit 2, before any work."""

from __future__ import annotations

import pytest
import typer

from lineside.cli import run_app
from tests.cli.cli_run import all_commands, assert_one_line_error, base_type, lineside_app, run_cli

APP = lineside_app()
COMMANDS = all_commands(APP)
# The click command tree typer makes of APP, made once: calling APP makes the same tree again on every call
# (0.04 s each, 300+ calls here), then parses with it exactly as below.
CLICK = typer.main.get_command(APP)


def _fill_arguments(cmd) -> list[str]:
    """Stand-in values for a command's required positional arguments: these cases stop at option parsing, before
    any argument is read, so any text does."""
    return ["ARG" for p in cmd.params if p.param_type_name == "argument" and p.required]


def _numeric_options():
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            if p.param_type_name == "option" and base_type(p) in (int, float):
                yield name, cmd, p


NUMERIC = list(_numeric_options())


def _in_process(argv: list[str], capsys) -> tuple[int, str]:
    code = run_app(CLICK, argv)
    return code, capsys.readouterr().err


def _assert_usage_line(code: int, err: str, command: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err and "╭" not in err, err
    assert f"see `lineside {command} --help`" in lines[0], err
    for n in needles:
        assert n in lines[0], (n, err)


def test_the_walk_finds_the_commands():
    assert {"build", "logits", "generate", "chat", "serve", "bench", "engine", "check", "jetson plan",
            "jetson service"} <= set(COMMANDS)
    assert len(NUMERIC) >= 40


def test_every_numeric_option_has_a_checked_range():
    """Each int/float option goes through cli_checks.number_option (range + finiteness checked while parsing)."""
    unchecked = [f"{name} {p.opts[0]}" for name, _, p in NUMERIC
                 if not hasattr(getattr(p.type_descriptor.parameter_info, "parser", None), "bounds")]
    assert not unchecked, unchecked


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unknown_option_is_one_line(command, capsys):
    code, err = _in_process([*command.split(), "--no-such-option-zz"], capsys)
    _assert_usage_line(code, err, command, "--no-such-option-zz")


@pytest.mark.parametrize("command", sorted(c for c, cmd in COMMANDS.items() if _fill_arguments(cmd)))
def test_missing_argument_is_one_line(command, capsys):
    code, err = _in_process([*command.split()], capsys)
    _assert_usage_line(code, err, command, "Missing")


def _first_value_option(cmd) -> str | None:
    """A command's first option that takes a value (not a flag), by its longest name."""
    for p in cmd.params:
        if p.param_type_name == "option" and not getattr(p, "is_flag", False) and p.nargs == 1:
            return max(p.opts, key=len)
    return None


@pytest.mark.parametrize("command", sorted(c for c, cmd in COMMANDS.items() if _first_value_option(cmd)))
def test_an_option_given_last_without_its_value_names_the_commands_help(command, capsys):
    """`lineside chat B --system` (the value forgotten): the parser's error carries no context, and the line said
    "see `lineside --help`", the top-level help, which lists no option of chat."""
    option = _first_value_option(COMMANDS[command])
    code, err = _in_process([*command.split(), *_fill_arguments(COMMANDS[command]), option], capsys)
    _assert_usage_line(code, err, command, option, "requires an argument")


def _bad_values(p) -> list[str]:
    b = p.type_descriptor.parameter_info.parser.bounds
    kind = b["kind"]
    vals = ["abc", "1.5"] if kind is int else ["abc", "nan", "inf", "-inf"]
    if b["low"] is not None:
        vals.append(str(b["low"] - 1))
    if b["above"] is not None:
        vals.append(str(b["above"]))
    if b["high"] is not None:
        vals.append(str(b["high"] + 1 if kind is int else b["high"] * 1.5 + 1))
    return vals


@pytest.mark.parametrize(("command", "option", "value"),
                         [(n, p.opts[0], v) for n, _, p in NUMERIC for v in _bad_values(p)],
                         ids=lambda x: str(x))
def test_every_numeric_option_refuses_out_of_range(command, option, value, capsys):
    code, err = _in_process([*command.split(), *_fill_arguments(COMMANDS[command]), f"{option}={value}"], capsys)
    _assert_usage_line(code, err, command, option)


@pytest.mark.parametrize(("command", "option"), [(n, p.opts[0]) for n, _, p in NUMERIC], ids=lambda x: str(x))
def test_every_numeric_option_accepts_its_bounds(command, option):
    """The parser accepts the edges of its own range (so the refusals above are about the range only)."""
    p = next(p for n, _, p in NUMERIC if n == command and p.opts[0] == option)
    parse = p.type_descriptor.parameter_info.parser
    b = parse.bounds
    for edge in (b["low"], b["high"]):
        if edge is not None:
            assert parse(str(edge)) == edge
    if b["above"] is not None:
        assert parse(str(b["above"] + 0.5)) == b["above"] + 0.5


# The same through the real command line (a fresh interpreter, as a user starts it), one case per kind of usage
# error.
@pytest.mark.parametrize(("argv", "needle"), [
    (["build", "ckpt", "-o", "out", "--bogus"], "--bogus"),
    (["build"], "Missing argument"),
    (["serve", "b", "--port", "abc"], "--port"),
    (["serve", "b", "--port", "70000"], "--port"),
    (["generate", "b", "--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["jetson", "plan", "m", "--device", "agx-orin-64", "--ctx", "0"], "--ctx"),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_usage_errors_from_the_real_command(argv, needle):
    proc = run_cli(*argv, fresh=True)
    line = assert_one_line_error(proc, needle, code=2)
    assert line.startswith("error: ") and "--help`" in line


@pytest.mark.parametrize("option", ["--served-model-name", "--allowed-hosts", "--lora-modules"])
def test_a_list_option_given_vllms_space_separated_values_says_to_repeat_it(option, capsys):
    """vLLM reads `--served-model-name a b` (nargs); here `b` was 'an unexpected extra argument' and nothing said
    that each value needs the option again."""
    code, err = _in_process(["serve", "ARG", option, "a=x", "b=y"], capsys)
    _assert_usage_line(code, err, "serve", "(b=y)", f"repeat {option} before each value")
    code, err = _in_process(["serve", "ARG", "extra"], capsys)  # no list option given: no such hint
    _assert_usage_line(code, err, "serve", "(extra)")
    assert "repeat" not in err
