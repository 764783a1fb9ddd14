"""A stdout that cannot hold every character (PYTHONIOENCODING=ascii, a C or Latin-1 locale, a pipe to a file on
such a system): the model's text is written as faithfully as the stream allows, never a UnicodeEncodeError."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cli.cli_run import REPO

TEXT = "café — 日本"

# the model "says" TEXT whatever the prompt: a random tiny model would rarely write non-ASCII on its own
_SAYS_TEXT = f"""
import sys
from lineside.cli import main
from lineside.runtime.generate import Generator
def stream(self, ids, *a, **k):
    yield from self.tokenizer.encode({TEXT!r}, add_special=False)
Generator.stream = stream
main(sys.argv[1:])
"""


def _run(args: list[str], encoding: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": encoding, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", _SAYS_TEXT, *args], input=stdin.encode(), capture_output=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "ascii:surrogateescape"])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_non_ascii_output_on_a_narrow_stdout_is_escaped_not_a_traceback(tiny_bundle, command, encoding):
    """The first non-ASCII character of the answer died on a UnicodeEncodeError traceback (exit 1), losing the
    rest of the answer."""
    args = [command, str(tiny_bundle), "--backend", "onnxruntime"]
    proc = _run(args + (["--prompt", "hi"] if command == "generate" else []), encoding, stdin="hi\n\n")
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0 and "Traceback" not in err, err
    out = proc.stdout.decode(encoding.split(":")[0])
    assert "café" in out if encoding == "latin-1" else r"caf\xe9" in out, out  # what the stream holds, as it is
    assert r"\u2014 \u65e5\u672c" in out, out  # the rest as Python escapes: visible, and the code points are kept


def test_help_on_an_ascii_stdout(tiny_bundle):
    """`lineside generate --help` died on a traceback under PYTHONIOENCODING=ascii (the help has "≥" in it)."""
    proc = _run(["generate", "--help"], "ascii")
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr
    assert b"--max-tokens" in proc.stdout
