"""`lineside chat` as a line engineer uses it: Ctrl-C stops an answer (not the chat), and a prompt whose fixed
part (the system prompt, the template) leaves no room in the context is refused once, up front."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from lineside.bundle import open_bundle
from lineside.cli import _raise_terminated, run_app
from lineside.runtime.generate import Generator
from lineside.runtime.tokenizer import Tokenizer
from tests.cli.cli_run import assert_one_line_error, lineside_app


class _Terminal(io.StringIO):
    """Typed lines: stdin at a terminal."""

    def isatty(self) -> bool:
        return True


def _interrupt_first_answer(monkeypatch, interrupt: Callable[[], None], after: int = 2) -> list[list[int]]:
    """Generator.stream calls ``interrupt`` (which raises) after ``after`` tokens of its first answer (as Ctrl-C lands between two
    steps); returns the prompts each call was given."""
    real = Generator.stream
    prompts: list[list[int]] = []

    def stream(self, ids, *args, **kwargs):
        prompts.append(list(ids))
        for i, t in enumerate(real(self, ids, *args, **kwargs)):
            if len(prompts) == 1 and i == after:
                interrupt()
            yield t

    monkeypatch.setattr(Generator, "stream", stream)
    return prompts


def _chat(monkeypatch, capsys, bundle, lines: str, at_a_terminal: bool = False) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", _Terminal(lines) if at_a_terminal else io.StringIO(lines))
    rc = run_app(lineside_app(), ["chat", str(bundle), "--backend", "onnxruntime", "--max-tokens", "6"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(tiny_bundle, monkeypatch, capsys):
    """Ctrl-C during an answer ended the whole chat (exit 130, the conversation lost, the shell prompt glued to the
    half answer); llama-cli -cnv and ollama run stop the answer and ask again."""
    def ctrl_c() -> None:
        raise KeyboardInterrupt

    prompts = _interrupt_first_answer(monkeypatch, ctrl_c)
    rc, out, err = _chat(monkeypatch, capsys, tiny_bundle, "first\nsecond\n", at_a_terminal=True)  # then Ctrl-D
    assert rc == 0, err
    assert out.count("you> ") == 3 and out.count("model> ") == 2, out
    assert out.endswith("you> \n"), out  # Ctrl-D leaves the terminal on a fresh line
    assert "Traceback" not in err and "stopped" in err, err
    assert len(prompts) == 2
    second = Tokenizer.from_bundle(open_bundle(tiny_bundle)).decode(prompts[1])
    assert "user: first" in second and "assistant: " in second, second  # the stopped turn is kept


@pytest.mark.parametrize("at_a_terminal", [False, True])
def test_a_blank_line_quits_at_a_terminal_and_is_skipped_in_piped_input(tiny_bundle, monkeypatch, capsys,
                                                                         at_a_terminal):
    """`lineside chat B < questions.txt` stopped at the first blank line between two questions, exit 0, every
    question after it dropped without a word. Piped, each line is a turn until the input ends; typed, an empty
    line still quits."""
    lines = "first\n\n   \nsecond\n"
    monkeypatch.setattr(sys, "stdin", _Terminal(lines) if at_a_terminal else io.StringIO(lines))
    rc = run_app(lineside_app(), ["chat", str(tiny_bundle), "--backend", "onnxruntime", "--max-tokens", "2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.count("model> ") == (1 if at_a_terminal else 2), out
    assert ("empty line to quit" in err) == at_a_terminal and "Traceback" not in err, err
    if not at_a_terminal:  # no one reads a prompt: stdout holds only the answers (one "you> " per line read it had,
        # blank ones too, glued to the answers: "you> you> you> model> ...")
        assert "you> " not in out and out.startswith("model> ") and out.count("\nmodel> ") == 1, out


def test_sigterm_during_an_answer_still_ends_the_chat(tiny_bundle, monkeypatch, capsys):
    _interrupt_first_answer(monkeypatch, lambda: _raise_terminated(signal.SIGTERM, None))
    rc, out, _ = _chat(monkeypatch, capsys, tiny_bundle, "first\nsecond\n\n")
    assert rc == 143 and out.count("model> ") == 1, out


def test_ctrl_c_during_generate_ends_the_text_on_its_own_line(tiny_bundle, monkeypatch, capsys):
    """Ctrl-C while `generate` streamed left the text without its newline: the shell prompt was glued to the last
    word on the terminal. The exit stays 130."""
    def ctrl_c() -> None:
        raise KeyboardInterrupt

    _interrupt_first_answer(monkeypatch, ctrl_c)
    rc = run_app(lineside_app(), ["generate", str(tiny_bundle), "--prompt", "hello", "--backend", "onnxruntime",
                                  "--max-tokens", "8"])
    out, err = capsys.readouterr()
    assert rc == 130 and "Traceback" not in err, (rc, err, out)
    assert out.endswith("\n") and out.count("\n") == 1, repr(out)


@pytest.mark.parametrize("args", [["--system", "x" * 400], ["--chat-template", "{% for m in messages %}" + "pad " * 300
                                                               + "{{ m.content }}{% endfor %}"]])
def test_a_fixed_prompt_past_the_context_is_one_line_up_front(tiny_bundle, args):
    """A --system (or template) that alone fills the context (256) told the user after every line to "type a
    shorter one", however short the line was."""
    proc = subprocess.run([sys.executable, "-m", "lineside", "chat", str(tiny_bundle), "--backend", "onnxruntime",
                           *args], input="hi\nhello\n\n", capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(proc, "256", code=1)
    assert "shorter one" not in line and ("--system" in line) == (args[0] == "--system"), line
    assert "you> " not in proc.stdout


def test_a_line_that_leaves_one_token_of_context_is_answered(tiny_bundle, monkeypatch, capsys):
    """A prompt of context - 1 tokens leaves room for one token (as `lineside generate` and the server answer it):
    chat refused that line as too long ("a prompt of 255 tokens, and the bundle's context is 256; type a shorter
    one"), and capped every answer one token short of the context."""
    tok = Tokenizer.from_bundle(open_bundle(tiny_bundle))
    limit = open_bundle(tiny_bundle).max_seq_len
    line = next(x for n in range(limit) if len(tok.encode_chat([{"role": "user", "content": (x := "a" * n)}]))
                == limit - 1)
    prompts = _interrupt_first_answer(monkeypatch, lambda: None, after=limit)
    rc, out, err = _chat(monkeypatch, capsys, tiny_bundle, line + "\n")
    assert rc == 0 and "shorter" not in err, err
    assert out.count("model> ") == 1 and len(prompts) == 1 and len(prompts[0]) == limit - 1, (out, err)


def test_forgetting_the_oldest_turns_is_said_once(tiny_bundle):
    """A conversation past the context (256) dropped its oldest turns without a word: the model then 'forgot'
    what the user said at the start, and nothing told them why."""
    lines = ["word " * 30] * 4
    proc = subprocess.run([sys.executable, "-m", "lineside", "chat", str(tiny_bundle), "--backend", "onnxruntime",
                           "--max-tokens", "3"], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("model> ") == 4, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if "oldest" in ln]
    assert len(notes) == 1 and "256" in notes[0], proc.stderr


_SHOW_PROMPTS = """
import sys
from lineside.cli import run_app
from lineside.runtime.generate import Generator
from tests.cli.cli_run import lineside_app
real = Generator.stream
def stream(self, ids, *a, **k):
    sys.stderr.write("PROMPT=" + repr(self.tokenizer.decode(ids)) + "\\n")
    return real(self, ids, *a, **k)
Generator.stream = stream
sys.exit(run_app(lineside_app(), sys.argv[1:]))
"""


def test_arrow_keys_at_a_terminal_edit_the_line(tiny_bundle):
    """At a terminal, chat read lines without line editing: "helo", Left, "l" sent the model "helo\\x1b[Dl" (the
    arrow's escape code as text) instead of "hello", and Up put "\\x1b[A" in the message instead of recalling a line."""
    import os
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: chat on the pty, printing each prompt the model is given
        os.execv(sys.executable, [sys.executable, "-c", _SHOW_PROMPTS, "chat", str(tiny_bundle), "--backend",
                                  "onnxruntime", "--max-tokens", "2"])
    seen = b""

    def until(needle: bytes, count: int = 1) -> None:
        nonlocal seen
        deadline = time.monotonic() + 120
        while seen.count(needle) < count and time.monotonic() < deadline:
            if select.select([fd], [], [], 1)[0]:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # the child exited
                    return
                if not chunk:
                    return
                seen += chunk

    try:
        until(b"you> ")
        os.write(fd, b"helo\x1b[Dl\r")
        until(b"you> ", 2)
        os.write(fd, b"\x04")
        until(b"no such text")  # to EOF
    finally:
        _, status = os.waitpid(pid, 0)
    text = seen.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    prompts = [ln.split("PROMPT=", 1)[1] for ln in text.splitlines() if "PROMPT=" in ln]  # after "model> "
    assert len(prompts) == 1 and "hello" in prompts[0] and "\\x1b" not in prompts[0], text


def _long_answers(monkeypatch) -> list[int]:
    """Generator.stream answers every prompt with as many tokens as it may ("a", never EOS); returns the prompt
    length of each call."""
    lengths: list[int] = []

    def stream(self, ids, max_tokens=128, *args, **kwargs):
        lengths.append(len(ids))
        yield from self.tokenizer.encode("a" * max_tokens, add_special=False)[:max_tokens]

    monkeypatch.setattr(Generator, "stream", stream)
    return lengths


def _chat_with(monkeypatch, capsys, bundle, lines: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    rc = run_app(lineside_app(), ["chat", str(bundle), "--backend", "onnxruntime", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_an_answer_cut_by_the_context_is_said(tiny_bundle, monkeypatch, capsys):
    """An answer that ran into the bundle's context (256) before --max-tokens ended mid-sentence without a word,
    like a complete one; `lineside generate` says so."""
    _long_answers(monkeypatch)
    rc, out, err = _chat_with(monkeypatch, capsys, tiny_bundle, "hi\n\n", "--max-tokens", "1000")
    assert rc == 0 and out.count("model> ") == 1, err
    notes = [ln for ln in err.splitlines() if "context" in ln]
    assert len(notes) == 1 and "256" in notes[0] and "--max-seq-len" in notes[0], err


def test_a_full_context_leaves_each_answer_room(tiny_bundle, monkeypatch, capsys):
    """Once the conversation filled the context, the oldest turns were forgotten only until 16 tokens were free:
    every later answer was cut at 16-odd tokens, mid-sentence, turn after turn. Older turns make room for the answer
    (--max-tokens, up to a quarter of the context) instead."""
    lengths = _long_answers(monkeypatch)
    rc, out, err = _chat_with(monkeypatch, capsys, tiny_bundle, "hi\n" * 6 + "\n", "--max-tokens", "64")
    assert rc == 0 and out.count("model> ") == 6, err
    assert all(256 - n >= 64 for n in lengths), lengths  # each answer had its 64 tokens of room
    assert "cut" not in err and sum("oldest" in ln for ln in err.splitlines()) == 1, err


@pytest.mark.parametrize("at_a_terminal", [False, True])
def test_a_piped_line_that_cannot_be_answered_makes_the_exit_non_zero(tiny_bundle, monkeypatch, capsys, at_a_terminal):
    """`lineside chat B < questions.txt > answers.txt` with one question past the context printed its error, skipped
    it and exited 0: a script saw success and an answers file one answer short. Piped, the other lines are still
    answered and the exit is 1 at the end; typed, the user sees the error and types again (exit 0 on quitting)."""
    lines = "first\n" + "a" * 600 + "\nsecond\n"
    rc, out, err = _chat(monkeypatch, capsys, tiny_bundle, lines, at_a_terminal=at_a_terminal)
    assert out.count("model> ") == 2, out
    assert err.count("error: ") == 1 and "Traceback" not in err, err
    assert rc == (0 if at_a_terminal else 1), err


@pytest.mark.parametrize("at_a_terminal", [False, True])
def test_a_line_past_the_context_is_named_for_the_input_kind(tiny_bundle, monkeypatch, capsys, at_a_terminal):
    """Piped (a file of questions), "type a shorter one" read oddly: the error names the line, says it was skipped
    and what to do; at a terminal it still asks for a shorter one. One line either way."""
    blank = "" if at_a_terminal else "\n"  # (a blank line quits at a terminal)
    rc, out, err = _chat(monkeypatch, capsys, tiny_bundle, "first\n" + blank + "a " * 200 + "\nsecond\n",
                         at_a_terminal=at_a_terminal)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err
    if at_a_terminal:
        assert "type a shorter one" in errors[0], errors
    else:  # line 3 of the input: the blank line between counts, as an editor numbers it
        assert "line 3 makes a prompt of" in errors[0] and "it was skipped" in errors[0], errors
        assert "shorten that line" in errors[0] and "type" not in errors[0], errors


def test_a_piped_line_that_is_not_utf8_is_named(tiny_bundle, monkeypatch, capsys):
    """The error names the line, and only that line is lost: stdin's text layer decoded 8 KiB at a time, so the
    bad byte of line 2 cost lines 1 and 3 too."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"first\ncaf\xe9\nthird\n"), encoding="utf-8"))
    rc = run_app(lineside_app(), ["chat", str(tiny_bundle), "--backend", "onnxruntime", "--max-tokens", "4"])
    out, err = capsys.readouterr()
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 1 and out.count("model> ") == 2, err
    assert len(errors) == 1 and "line 2" in errors[0] and "skipped" in errors[0] and "type" not in errors[0], errors
