"""`lineside generate` and `lineside chat` count a long prompt with an early stop at the bundle's context
(runtime/bounded_encode, as the server counts a request's): a 30 MB prompt or piped chat line is refused after about
the context's worth of tokenizing, not the whole text's, and the one line still says how long it is (an estimate,
said to be one, when the rest was not read)."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import Any

import pytest

from lineside.cli import run_app
from lineside.runtime import commands
from tests.cli.cli_run import assert_one_line_error, lineside_app

ARGS = ["--max-tokens", "4", "--backend", "onnxruntime"]


class CountingTokenizer:
    """The tokenizers.Tokenizer under lineside's Tokenizer, counting the characters it is asked to encode."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.chars = 0
        self.longest = 0

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self.chars += len(text)
        self.longest = max(self.longest, len(text))
        return self._inner.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def counted(monkeypatch) -> list[CountingTokenizer]:
    """Every generate's tokenizer is a CountingTokenizer (listed here once the model has loaded)."""
    made: list[CountingTokenizer] = []
    real = commands._generator

    def generator(*args: Any, **kwargs: Any) -> Any:
        gen = real(*args, **kwargs)
        made.append(CountingTokenizer(gen.tokenizer._tok))
        gen.tokenizer._tok = made[-1]
        return gen

    monkeypatch.setattr(commands, "_generator", generator)
    return made


def _generate(monkeypatch, capsys, args: list, stdin: bytes = b"") -> subprocess.CompletedProcess:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    rc = run_app(lineside_app(), ["generate", *map(str, args), *ARGS])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


# words (cut points every few characters) and one stretch without a cut (bounded from its bytes)
@pytest.mark.parametrize("text", ["the quick brown fox jumps. " * 40_000, "ab" * 600_000],
                         ids=["words", "no-spaces"])
@pytest.mark.parametrize("how", ["stdin", "--prompt", "--chat"])
def test_a_huge_prompt_is_refused_without_tokenizing_all_of_it(tiny_bundle, monkeypatch, capsys, counted, text,
                                                              how):
    args = [tiny_bundle, "-"] if how == "stdin" else [tiny_bundle, "--prompt", text]
    if how == "--chat":
        args.append("--chat")
    proc = _generate(monkeypatch, capsys, args, text.encode() if how == "stdin" else b"")
    line = assert_one_line_error(proc, "the prompt has", "tokens", "context is 256 tokens", "shorten it", code=1)
    if "about" in line:  # counted in part: an estimate, and said to be one
        assert "estimated" in line and "the rest was not tokenized" in line, line
        assert how == "--chat" or f"of {len(text)} characters" in line  # (--chat: the text in the template's markup)
    else:  # bounded from all its bytes without tokenizing them
        assert "at least" in line, line
    tok = counted[0]
    assert tok.longest < 10_000 and tok.chars < 100_000, (tok.longest, tok.chars)  # the text is over 1M characters


def test_a_prompt_just_past_the_context_has_its_exact_count(tiny_bundle, monkeypatch, capsys, counted):
    """Tokenized whole (short enough to cost no more than counting it): the count is exact, without "about"."""
    from lineside.bundle import open_bundle
    from lineside.runtime.tokenizer import Tokenizer

    text = "x y " * 80
    exact = len(Tokenizer.from_bundle(open_bundle(tiny_bundle)).encode(text))
    assert exact >= 256
    line = assert_one_line_error(_generate(monkeypatch, capsys, [tiny_bundle, "--prompt", text]),
                                 f"{exact} tokens", "context is 256", code=1)
    assert "about" not in line


def test_a_prompt_that_fits_is_answered_as_before(tiny_bundle, monkeypatch, capsys, counted):
    proc = _generate(monkeypatch, capsys, [tiny_bundle, "--prompt", "hello " * 30])
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


def _chat(monkeypatch, capsys, lines: bytes, *args: str) -> subprocess.CompletedProcess:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines), encoding="utf-8"))
    rc = run_app(lineside_app(), ["chat", *map(str, args), "--backend", "onnxruntime", "--max-tokens", "4"])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


@pytest.mark.parametrize("text", ["the quick brown fox jumps. " * 40_000, "ab" * 600_000],
                         ids=["words", "no-spaces"])
def test_a_huge_piped_chat_line_is_skipped_without_tokenizing_all_of_it(tiny_bundle, monkeypatch, capsys, counted,
                                                                       text):
    proc = _chat(monkeypatch, capsys, f"hello\n{text}\nagain\n".encode(), tiny_bundle, "--system", "be brief")
    assert proc.returncode == 1 and proc.stdout.count("model> ") == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "line 2 makes a prompt of at least" in errors[0] and "skipped" in errors[0], errors
    tok = counted[0]
    assert tok.longest < 10_000 and tok.chars < 100_000, (tok.longest, tok.chars)  # the line is over 1M characters
