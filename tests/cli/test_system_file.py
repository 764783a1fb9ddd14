"""`--system-file PATH` on `lineside chat` and `lineside generate --chat`: a long system prompt from a file, as
llama.cpp's --system-prompt-file takes one; the file's text is what --system gives, and a missing, unreadable,
non-UTF-8, empty or oversized file (or both options) is one line before the model loads."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from lineside.bundle import open_bundle
from lineside.cli import run_app
from lineside.runtime import select
from lineside.runtime.generate import Generator
from lineside.runtime.tokenizer import Tokenizer
from tests.cli.cli_run import assert_one_line_error, lineside_app

ARGS = ["--backend", "onnxruntime", "--max-tokens", "4"]
SYSTEM = "You are a terse assistant.\nAnswer in one word — always."
STREAM = Generator.stream  # the real one: each run below wraps it afresh (not the last run's wrapper)


def _run(monkeypatch, capsys, args: list, stdin: str = "") -> tuple[int, str, str, list[list[int]]]:
    """The command in-process with a piped stdin; returns (rc, stdout, stderr, the prompt ids each answer got)."""
    prompts: list[list[int]] = []

    def stream(self, ids, *a, **k):
        prompts.append(list(ids))
        yield from STREAM(self, ids, *a, **k)

    monkeypatch.setattr(Generator, "stream", stream)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8"))
    rc = run_app(lineside_app(), [*map(str, args), *ARGS])
    out, err = capsys.readouterr()
    return rc, out, err, prompts


@pytest.mark.parametrize("command", [["chat"], ["generate", "--chat", "--prompt", "hello there"]])
def test_the_files_text_is_the_system_prompt(tiny_bundle, tmp_path, monkeypatch, capsys, command):
    """A file saved by a Windows editor (BOM, CRLF line ends, a trailing newline) gives the prompt --system gives
    with its text; the model sees it as the template's system message."""
    path = tmp_path / "system.txt"
    path.write_bytes(b"\xef\xbb\xbf" + SYSTEM.replace("\n", "\r\n").encode() + b"\r\n")
    want_ids = Tokenizer.from_bundle(open_bundle(tiny_bundle)).encode_chat(
        [{"role": "system", "content": SYSTEM.replace("\n", "\r\n")}, {"role": "user", "content": "hello there"}])
    cmd, rest = command[0], command[1:]
    given = _run(monkeypatch, capsys, [cmd, tiny_bundle, *rest, "--system", SYSTEM.replace("\n", "\r\n")],
                 "hello there\n")
    from_file = _run(monkeypatch, capsys, [cmd, tiny_bundle, *rest, "--system-file", path], "hello there\n")
    assert given[0] == from_file[0] == 0, (given[2], from_file[2])
    assert from_file[3] == given[3] == [want_ids]
    assert from_file[1] == given[1]


def test_a_system_file_that_fills_the_context_is_named(tiny_bundle, tmp_path, monkeypatch, capsys):
    path = tmp_path / "long.txt"
    path.write_text("be brief " * 200)  # past the tiny bundle's context of 256
    rc, out, err, _ = _run(monkeypatch, capsys, ["chat", tiny_bundle, "--system-file", path], "hi\n")
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "--system-file", "context", code=1)


def _bad_files(tmp_path):
    """name → (path, what the line says); made on demand (a FIFO-free, root-proof set: chmod does not stop root)."""
    (tmp_path / "latin1.txt").write_bytes(b"r\xe9ponds bri\xe8vement\n")
    (tmp_path / "empty.txt").write_bytes(b"\r\n\n")
    (tmp_path / "plain.txt").write_text("be brief")
    return {
        "missing": (tmp_path / "nope.txt", ("no such file",)),
        "directory": (tmp_path, ("is a directory",)),
        "not-utf8": (tmp_path / "latin1.txt", ("not valid UTF-8", "byte 2", "0xe9", "iconv")),
        "empty": (tmp_path / "empty.txt", ("is empty",)),
        "under-a-file": (tmp_path / "plain.txt" / "x", ("cannot read",)),
    }


@pytest.mark.parametrize("command", [["chat"], ["generate", "--chat", "--prompt", "hi"]])
@pytest.mark.parametrize("case", ["missing", "directory", "not-utf8", "empty", "under-a-file", "oversized"])
def test_a_bad_system_file_is_one_line_before_the_model_loads(tiny_bundle, tmp_path, monkeypatch, capsys, command,
                                                               case):
    from lineside.runtime import system_input

    made: list[int] = []
    monkeypatch.setattr(select, "choose_backend", lambda *a, **k: made.append(1))
    if case == "oversized":  # the cap generate puts on a stdin prompt (32 MiB), made small here
        monkeypatch.setattr(system_input, "MAX_STDIN_BYTES", 16)
        path, needles = tmp_path / "big.txt", ("is over", "shorter")
        path.write_text("x" * 17)
    else:
        path, needles = _bad_files(tmp_path)[case]
    rc, out, err, _ = _run(monkeypatch, capsys, [command[0], tiny_bundle, *command[1:], "--system-file", path], "hi\n")
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "--system-file", str(path), *needles, code=1)
    assert out == "" and not made


@pytest.mark.parametrize("args", [
    ["chat", "--system", "a", "--system-file", "{f}"],
    ["generate", "--chat", "--prompt", "hi", "--system", "a", "--system-file", "{f}"],
])
def test_both_system_options_are_a_usage_error(tiny_bundle, tmp_path, monkeypatch, capsys, args):
    (tmp_path / "s.txt").write_text("be brief")
    args = [a.replace("{f}", str(tmp_path / "s.txt")) for a in args]
    rc, out, err, _ = _run(monkeypatch, capsys, [args[0], tiny_bundle, *args[1:]], "hi\n")
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "--system", "--system-file", "one of them",
                          code=2)


@pytest.mark.parametrize("option", ["--system", "--system-file"])
def test_a_system_prompt_without_chat_is_refused_by_generate(tiny_bundle, tmp_path, monkeypatch, capsys, option):
    """Without --chat the prompt goes to the model as it is: a system prompt would be dropped without a word."""
    (tmp_path / "s.txt").write_text("be brief")
    value = str(tmp_path / "s.txt") if option == "--system-file" else "be brief"
    rc, out, err, _ = _run(monkeypatch, capsys, ["generate", tiny_bundle, "--prompt", "hi", option, value])
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), option, "needs --chat", code=1)
