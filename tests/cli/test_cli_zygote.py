"""The CLI tests' zygote (tests/cli/cli_zygote.py) stands for a fresh `python -m lineside`: the same exit code,
stdout and stderr, byte for byte, for a success, a usage error and a user error; a timeout kills the child."""

from __future__ import annotations

import subprocess

import pytest

from tests.cli.cli_run import run_cli


@pytest.mark.parametrize("argv", [["--help"], ["nosuchcommand"], ["serve", "b", "--port", "abc"],
                                  ["build", "/nonexistent/ckpt", "-o", "/nonexistent/out"]])
def test_forked_equals_fresh(argv):
    forked, fresh = run_cli(*argv), run_cli(*argv, fresh=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_timeout_kills_the_child():
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("serve", "/nonexistent/bundle", timeout=0.001)
    assert run_cli("nosuchcommand").returncode == 2  # the zygote still answers
