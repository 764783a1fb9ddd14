"""The `lineside` command: one subcommand per part. User errors print one line and exit non-zero."""

from __future__ import annotations

import importlib
import sys

import typer

from lineside.errors import LinesideError

app = typer.Typer(
    name="lineside",
    help="Compile checkpoints into W4A16 ONNX/TensorRT bundles and serve them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each part registers its commands in its own module (keeps this file small and the parts apart).
_COMMAND_MODULES = (
    "lineside.build.commands",
    "lineside.build.tensorrt.commands",
    "lineside.runtime.commands",
    "lineside.server.commands",
    "lineside.bench.commands",
    "lineside.jetson.commands",
    "lineside.fleet.commands",
    "lineside.deploy.commands",
)


def _register() -> None:
    for mod_name in _COMMAND_MODULES:
        importlib.import_module(mod_name).register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning LinesideError into one line on stderr and exit code 1."""
    _register()
    try:
        app(args=argv, standalone_mode=True)
    except LinesideError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
