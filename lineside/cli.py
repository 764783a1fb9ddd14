"""The `lineside` command: one subcommand per part. User errors print one line and exit non-zero."""

from __future__ import annotations

import codecs
import contextlib
import errno
import importlib
import os
import signal
import sys
from collections.abc import Iterator

import typer

from lineside import __version__
from lineside.errors import LinesideError

try:  # typer ≥ 0.2x carries its own copy of click
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, UsageError

PROG = "lineside"

app = typer.Typer(
    name=PROG,
    help="Compile checkpoints into W4A16 ONNX/TensorRT bundles and serve them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each part registers its commands in its own module (keeps this file small and the parts apart).
_COMMAND_MODULES = (
    "lineside.build.commands",
    "lineside.build.tensorrt.commands",
    "lineside.build.lora_commands",
    "lineside.runtime.commands",
    "lineside.server.commands",
    "lineside.bench.commands",
    "lineside.jetson.commands",
    "lineside.fleet.commands",
    "lineside.deploy.commands",
)


# The commands each module registers: `lineside serve ...` imports only the server's (the others' imports
# cost ~0.1-0.2 s of CPU before the server can start loading its model); anything else imports all.
_COMMANDS = {"build": "lineside.build.commands", "engine": "lineside.build.tensorrt.commands",
             "check": "lineside.build.tensorrt.commands", "chat": "lineside.runtime.commands",
             "logits": "lineside.runtime.commands", "generate": "lineside.runtime.commands",
             "serve": "lineside.server.commands", "bench": "lineside.bench.commands",
             "jetson": "lineside.jetson.commands", "fleet": "lineside.fleet.commands",
             "deploy": "lineside.deploy.commands"}


def _print_version(value: bool) -> None:
    if value:
        print(f"{PROG} {__version__}")
        raise typer.Exit()


@app.callback()
def _commands(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                           help="print lineside's version and exit")) -> None:
    """A group callback keeps `lineside CMD` a group when only CMD's module is registered (typer runs a lone
    command without its name otherwise). ``--version``: what a bug report or an upgrade check asks first."""


def _register(argv: list[str] | None = None) -> None:
    """Register every command, or only the module of the command ``argv`` names."""
    first = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    modules = [_COMMANDS[first]] if first in _COMMANDS else _COMMAND_MODULES
    for mod_name in modules:
        importlib.import_module(mod_name).register(app)


def one_line(text: str) -> str:
    """Collapse a message onto one line (typer wraps some of its own; a user error is one line)."""
    return " ".join(str(text).split())


def usage_line(e: UsageError, prog: str = PROG, cli: object = None, argv: list[str] | None = None) -> str:
    """typer's usage error (unknown option, missing argument, bad value) as one line naming where help is."""
    path = e.ctx.command_path if e.ctx is not None else _argv_command_path(cli, argv, prog)
    return f"error: {one_line(e.format_message()).rstrip('.')}{_repeat_hint(e)}; see `{path} --help`"


def _argv_command_path(cli: object, argv: list[str] | None, prog: str) -> str:
    """The command ``argv`` names (`lineside chat`), for a parser error that carries no context: an option given
    last without its value ("requires an argument") pointed at `lineside --help`, which lists no options."""
    try:
        cmd = typer.main.get_command(cli) if isinstance(cli, typer.Typer) else cli
    except Exception:  # noqa: BLE001 - only a nicer hint is lost
        return prog
    words = [prog]
    for arg in sys.argv[1:] if argv is None else argv:
        sub = getattr(cmd, "commands", {}).get(arg) if not arg.startswith("-") else None
        if sub is None:
            if arg.startswith("-"):
                continue  # a group's own flag (`--version`) before the command's name
            break  # the command's first argument: the path is complete
        cmd = sub
        words.append(arg)
    return " ".join(words)


def _repeat_hint(e: UsageError) -> str:
    """Extra arguments after a list option given once are vLLM's `--served-model-name a b` (nargs): here each
    value takes the option again, which the parser's own message does not say."""
    if e.ctx is None or "unexpected extra argument" not in e.format_message():
        return ""
    given = [p for p in e.ctx.command.params if p.param_type_name == "option" and getattr(p, "multiple", False)
             and e.ctx.params.get(p.name)]
    if len(given) != 1:
        return ""
    opt = max(given[0].opts, key=len)
    return f" (a list option takes one value each time: repeat {opt} before each value)"


def os_error_line(e: OSError) -> str:
    """An OSError that escaped the up-front checks (disk full, a file removed meanwhile) as one line."""
    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or one_line(str(e)) or type(e).__name__
    hint = {errno.ENOSPC: "free some space or write elsewhere", errno.EDQUOT: "free some space or write elsewhere",
            errno.EACCES: "check the permissions", errno.EPERM: "check the permissions",
            errno.EROFS: "write somewhere else",
            errno.EFBIG: "a file reached the size limit (`ulimit -f`, or the filesystem's largest file); raise the "
                         "limit or write elsewhere"}.get(e.errno or 0, "check the path")
    return f"error: {where}{what}; {hint}"


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, systemd stopping a unit), raised where the main thread is so that what a
    command cleans up on Ctrl-C (a build's ``OUT.partial``) is cleaned up on it too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


INTERRUPTED = 128 + signal.SIGINT  # a command stopped by Ctrl-C: what shells report for it (no command returns it)
_terminated_by: list[int] = []  # the signal that interrupted the running command (typer turns it into exit 130)


def _raise_terminated(signum: int, _frame: object) -> None:
    _terminated_by.append(signum)
    raise Terminated(signum)


def _terminated_line() -> int:
    signum = _terminated_by[0]
    print(f"interrupted by {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + signum


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While a command runs, SIGTERM interrupts it like Ctrl-C (Python's default is to die on the spot, leaving
    half-written output). A SIGTERM someone set to be ignored stays ignored; `serve` installs its own drain for
    it while it serves."""
    previous = None
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: signals stay as they are
        pass
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _escape_unencodable(e: UnicodeError) -> tuple[str | bytes, int]:
    """Error handler for stdout: a lone surrogate that stands for an undecodable byte (a file name read under
    surrogateescape) is written as that byte, as Python does; any other character the encoding lacks as its
    Python escape (\\xe9, \\u65e5)."""
    if not isinstance(e, UnicodeEncodeError):
        raise e
    bad = e.object[e.start:e.end]
    if all("\udc80" <= ch <= "\udcff" for ch in bad):
        return bytes(ord(ch) - 0xDC00 for ch in bad), e.end
    return codecs.backslashreplace_errors(e)


codecs.register_error("lineside.escape", _escape_unencodable)


def tolerant_stdout() -> None:
    """Under a stdout encoding that lacks some characters (PYTHONIOENCODING=ascii, a C or Latin-1 locale, a pipe
    to a file there), the first one in the model's text or a help page died on a UnicodeEncodeError traceback.
    They are escaped instead, as Python's own stderr does: the locale says what the reader decodes, so UTF-8
    bytes would be mojibake there, while an escape is visible and keeps the code point. Every character the
    encoding has is written as before."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None and not sys.stdout.closed and sys.stdout.errors in ("strict", "surrogateescape"):
        reconfigure(errors="lineside.escape")


def run_app(cli: typer.Typer, argv: list[str] | None, prog: str = PROG) -> int:
    """Run a typer app and return its exit code, every failure printed as one line on stderr (no rich box,
    no traceback; LINESIDE_DEBUG=1 re-raises unexpected ones). Also used by build_engine.py."""
    debug = os.environ.get("LINESIDE_DEBUG", "") not in ("", "0")
    _terminated_by.clear()
    tolerant_stdout()
    try:
        with _sigterm_interrupts():
            rv = cli(args=argv, prog_name=prog, standalone_mode=False)
        if _terminated_by:
            return _terminated_line()
        if rv == INTERRUPTED:  # typer turns a KeyboardInterrupt that leaves a command into exit 130 without a word
            print("interrupted", file=sys.stderr)
        return rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
    except UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # nothing given: the help is the answer (click ≥ 8.2)
            print(e.format_message(), file=sys.stderr)
            return 2
        print(usage_line(e, prog, cli, argv), file=sys.stderr)
        return 2
    except ClickException as e:
        print(f"error: {one_line(e.format_message())}", file=sys.stderr)
        return e.exit_code or 1
    except LinesideError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except Terminated:
        return _terminated_line()
    except (KeyboardInterrupt, typer.Abort):
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the reader went away (e.g. `| head`)
        return 1
    except MemoryError:
        if debug:
            raise
        print("error: out of memory; use smaller options (--max-seq-len, --num-slots, --batch) or a machine "
              "with more memory", file=sys.stderr)
        return 1
    except OSError as e:
        if debug:
            raise
        print(os_error_line(e), file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI; a user error is one line on stderr and a non-zero exit."""
    from lineside.legacy_env import adopt_old_names

    for note in adopt_old_names():  # TRTEDGE_* from before the rename: read, and said to be renamed
        print(note, file=sys.stderr)
    _register(argv)
    sys.exit(run_app(app, argv))  # SystemExit(0) on success too, as typer's standalone mode does


if __name__ == "__main__":  # `python -m lineside.cli ...`, as `python -m lineside ...`
    # run the package's module, not this __main__ copy of it: the command modules import lineside.cli (its app, its
    # Terminated), and run_app must catch the classes they raise
    from lineside.cli import main as _main

    _main()
