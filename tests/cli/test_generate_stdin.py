"""`lineside generate` takes its prompt as PROMPT, --prompt, or from stdin (`-`, or piped with no prompt), as `llm`,
`ollama run MODEL < file` and llama.cpp's `-f` users expect; a prompt that is missing, empty, not UTF-8 or given
twice is one line before the model loads."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from lineside.cli import run_app
from tests.cli.cli_run import assert_one_line_error, lineside_app

ARGS = ["--max-tokens", "6", "--backend", "onnxruntime"]


class _Terminal(io.TextIOWrapper):
    """stdin at a terminal."""

    def isatty(self) -> bool:
        return True


def _stdin(data: bytes, terminal: bool = False) -> io.TextIOWrapper:
    """A piped stdin as Python opens it: text over a byte buffer."""
    return (_Terminal if terminal else io.TextIOWrapper)(io.BytesIO(data), encoding="utf-8")


def _generate(monkeypatch, capsys, args: list, stdin: io.TextIOBase | None) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", stdin)
    rc = run_app(lineside_app(), ["generate", *map(str, args), *ARGS])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_prompt_from_stdin_is_the_prompt_given_as_text(tiny_bundle, monkeypatch, capsys):
    """`lineside generate B < prompt.txt` and `lineside generate B - < prompt.txt` were refused ("Missing option
    '--prompt'"); they answer as `--prompt "$(cat prompt.txt)"` does (the shell drops the trailing newlines too),
    and as PROMPT given as text."""
    rc, want, err = _generate(monkeypatch, capsys, [tiny_bundle, "--prompt", "the quick brown fox"], _stdin(b""))
    assert rc == 0 and want.strip(), err
    for args, data in (([tiny_bundle], b"the quick brown fox\n"), ([tiny_bundle, "-"], b"the quick brown fox\n\n"),
                       ([tiny_bundle, "--prompt", "-"], b"the quick brown fox"),
                       ([tiny_bundle, "the quick brown fox"], b"ignored: the prompt is given")):
        rc, out, err = _generate(monkeypatch, capsys, args, _stdin(data))
        assert (rc, out) == (0, want), (args, err)


def test_a_multi_line_prompt_from_stdin_keeps_its_lines(tiny_bundle, monkeypatch, capsys):
    text = "first line\nsecond line\n\nthird"
    rc, want, _ = _generate(monkeypatch, capsys, [tiny_bundle, text], _stdin(b""))
    rc2, got, err = _generate(monkeypatch, capsys, [tiny_bundle, "-"], _stdin(text.encode() + b"\r\n"))
    assert rc == rc2 == 0 and got == want, err


@pytest.mark.parametrize(("args", "data", "needles", "code"), [
    ([], b"", ("stdin is empty", "--prompt"), 1),  # cron's </dev/null with no prompt given
    (["-"], b" \n\n", ("stdin is empty",), 1),
    (["-"], b"caf\xe9 au lait\n", ("not valid UTF-8", "byte 4", "0xe9", "iconv"), 1),
    (["x", "--prompt", "y"], b"", ("given twice", "generate --help"), 2),
])
def test_a_bad_prompt_on_stdin_is_one_line_before_the_model_loads(tiny_bundle, monkeypatch, capsys, args, data,
                                                                  needles, code):
    rc, out, err = _generate(monkeypatch, capsys, [tiny_bundle, *args], _stdin(data))
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), *needles, code=code)
    assert out == "" and "backend" not in err


def test_no_prompt_at_a_terminal_says_how_to_give_one(tiny_bundle, monkeypatch, capsys):
    """At a terminal, no prompt is a usage error (exit 2), not a silent wait for Ctrl-D that looks like a hang."""
    rc, out, err = _generate(monkeypatch, capsys, [tiny_bundle], _stdin(b"never read", terminal=True))
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "no prompt", "PROMPT", "--prompt",
                          "generate BUNDLE -", code=2)


def test_an_explicit_dash_at_a_terminal_reads_what_is_typed(tiny_bundle, monkeypatch, capsys):
    rc, want, _ = _generate(monkeypatch, capsys, [tiny_bundle, "typed prompt"], _stdin(b""))
    rc2, out, err = _generate(monkeypatch, capsys, [tiny_bundle, "-"], _stdin(b"typed prompt\n", terminal=True))
    assert rc == rc2 == 0 and out == want and "Ctrl-D" in err, err


def test_a_closed_stdin_is_one_line(tiny_bundle, monkeypatch, capsys):
    rc, out, err = _generate(monkeypatch, capsys, [tiny_bundle], None)  # `<&-`: Python has no sys.stdin
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "stdin is closed", "--prompt", code=1)


def test_a_real_pipe(tiny_bundle):
    """The bytes of a real pipe, through a fresh interpreter: the prompt is read before the model loads."""
    cmd = [sys.executable, "-m", "lineside", "generate", str(tiny_bundle), *ARGS]
    piped = subprocess.run(cmd, input=b"hello there\n", capture_output=True, timeout=120)
    given = subprocess.run([*cmd, "--prompt", "hello there"], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=120)
    assert piped.returncode == given.returncode == 0, piped.stderr
    assert piped.stdout == given.stdout


def test_a_stdin_past_any_context_is_refused_unread(tiny_bundle, monkeypatch, capsys):
    """`lineside generate B < /dev/zero` (or a log file by mistake) read stdin until memory ran out: it is read up
    to 32 MiB (what `serve` takes of a request body) and refused past that, before the model loads."""
    from lineside.runtime import prompt_input

    class Endless(io.RawIOBase):
        """/dev/zero: never ends; counts what was read of it."""

        read_bytes = 0

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:
            b[:] = b"a" * len(b)
            Endless.read_bytes += len(b)
            return len(b)

    assert prompt_input.MAX_STDIN_BYTES == 32 << 20
    rc, out, err = _generate(monkeypatch, capsys, [tiny_bundle, "-"],
                             io.TextIOWrapper(io.BufferedReader(Endless()), encoding="utf-8"))
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "over 32 MiB", "shorter", code=1)
    assert Endless.read_bytes <= (32 << 20) + (1 << 20) and "backend" not in err


@pytest.fixture(scope="module")
def no_bos_bundle(tiny_bundle, tmp_path_factory):
    """The tiny bundle as a model whose tokenizer adds no BOS token (add_bos_token false, as Qwen2's or SmolLM2's):
    an empty prompt is then no token at all."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("no-bos") / tiny_bundle.name
    shutil.copytree(tiny_bundle, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["add_bos_token"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("prompt", ["", "\u200b\ufeff"])  # nothing, or only invisible characters (stripped)
def test_an_empty_prompt_on_a_bundle_without_bos_is_refused_before_the_model_loads(no_bos_bundle, monkeypatch,
                                                                                 capsys, prompt):
    """Nothing to continue: the model loaded (seconds, for a real one) before "empty after tokenization". One line
    now, before any backend is made; with a BOS-adding tokenizer, or with --chat (the template's tokens), an empty
    prompt is still generated from."""
    from lineside.runtime import select

    made = []
    real = select.choose_backend
    monkeypatch.setattr(select, "choose_backend", lambda *a, **k: made.append(1) or real(*a, **k))
    rc, out, err = _generate(monkeypatch, capsys, [no_bos_bundle, prompt], _stdin(b""))
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "prompt is empty", "BOS", "--chat", code=1)
    assert out == "" and not made
    rc, out, err = _generate(monkeypatch, capsys, [no_bos_bundle, prompt, "--chat"], _stdin(b""))
    assert rc == 0 and made, err


def test_an_empty_prompt_on_a_bundle_that_adds_bos_is_generated_from(tiny_bundle, monkeypatch, capsys):
    rc, out, err = _generate(monkeypatch, capsys, [tiny_bundle, ""], _stdin(b""))
    assert rc == 0 and out.strip(), err
