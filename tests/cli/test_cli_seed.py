"""`--seed` of `lineside generate` and `lineside chat` reads as the server's seed: any 64-bit integer, -1 meaning
no seed (a random one each run), as vLLM's SamplingParams, llama.cpp's server and llama.cpp's `--seed -1` read it;
`--seed -1` was refused as out of range, and chat had no --seed at all."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest

from lineside.cli import run_app
from lineside.runtime.generate import Generator
from lineside.runtime.sampling import sampler_seed
from tests.cli.cli_run import lineside_app

ARGS = ["--max-tokens", "5", "--temperature", "1.5", "--backend", "onnxruntime"]


@pytest.fixture
def seeds(monkeypatch) -> list[Any]:
    """The seed of every stream's SamplingParams."""
    got: list[Any] = []
    real = Generator.stream

    def stream(self, ids, max_tokens=128, params=None, **kwargs):
        got.append(params.seed)
        return real(self, ids, max_tokens, params, **kwargs)

    monkeypatch.setattr(Generator, "stream", stream)
    return got


def _run(monkeypatch, capsys, args: list, stdin: bytes = b"") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    rc = run_app(lineside_app(), [*map(str, args), *ARGS])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("seed", ["-1", "-5", "0", "7", str(2**63 - 1), str(-(2**63))])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_seed_is_read_as_the_server_reads_it(tiny_bundle, monkeypatch, capsys, seeds, command, seed):
    args = [command, tiny_bundle, "--seed", seed] + (["--prompt", "hello"] if command == "generate" else [])
    rc, out, err = _run(monkeypatch, capsys, args, b"hello\n")
    assert rc == 0 and out.strip(), err
    assert seeds == [sampler_seed(int(seed))]
    assert (seeds[0] is None) == (seed == "-1")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_same_seed_gives_the_same_text(tiny_bundle, monkeypatch, capsys, seeds, command):
    args = [command, tiny_bundle, "--seed", "-5"] + (["--prompt", "hello"] if command == "generate" else [])
    first = _run(monkeypatch, capsys, args, b"hello\nagain\n")
    assert first[0] == 0 and first == _run(monkeypatch, capsys, args, b"hello\nagain\n")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_seed_past_64_bits_is_one_line(tiny_bundle, monkeypatch, capsys, command):
    rc, out, err = _run(monkeypatch, capsys, [command, tiny_bundle, "--seed", str(2**63)], b"hello\n")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--seed" in err and "out of range" in err, err


def test_help_says_what_minus_one_means():
    from typer.testing import CliRunner

    for command in ("generate", "chat"):
        text = " ".join(CliRunner().invoke(lineside_app(), [command, "--help"], env={"COLUMNS": "300"}).output.split())
        assert "-1 (or none) picks a random one" in text, text
