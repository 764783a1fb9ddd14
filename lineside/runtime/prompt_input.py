"""Where `lineside generate` takes its prompt from: the PROMPT argument, --prompt, or stdin (`-`, or piped with
no prompt given), as `llm`, `ollama run MODEL < file` and llama.cpp's `-f` users expect."""

from __future__ import annotations

import sys
from typing import IO

from lineside.errors import ArgumentsError, LinesideError

STDIN = "-"  # the PROMPT (or --prompt) that means "read it from stdin", as cat, llm and most Unix tools take it
HOW = ("give it as PROMPT (lineside generate BUNDLE \"TEXT\"), with --prompt TEXT, or on stdin "
       "(lineside generate BUNDLE - < prompt.txt)")
HELP = "see `lineside generate --help`"
# the most of stdin read as a prompt: as much as `serve` reads of a request body, more than any context holds;
# `< /dev/zero` or a log file by mistake is refused instead of read until memory runs out
MAX_STDIN_BYTES = 32 << 20


def prompt_text(argument: str | None, option: str | None, stdin: IO[str] | None = None) -> str:
    """The prompt, from the argument or the option (one of them), else from stdin when it is piped; a usage error
    (exit 2) when none is given at a terminal, since waiting there for Ctrl-D would look like a hang."""
    stdin = sys.stdin if stdin is None else stdin
    if argument is not None and option is not None:
        raise ArgumentsError(f"the prompt is given twice (PROMPT {argument[:20]!r} and --prompt); give one of them; "
                             f"{HELP}")
    given = argument if argument is not None else option
    if given is not None and given != STDIN:
        return given
    if stdin is None or stdin.closed:  # `<&-`: fd 0 closed
        raise LinesideError(f"the prompt is to be read from stdin, and stdin is closed; {HOW}")
    if given is None and stdin.isatty():
        raise ArgumentsError(f"no prompt; {HOW}; {HELP}")
    if stdin.isatty():  # an explicit `-` at a terminal: read what is typed, as cat does, and say how it ends
        print("reading the prompt from stdin; end it with Ctrl-D", file=sys.stderr)
    return _read(stdin)


def _read(stdin: IO[str]) -> str:
    """All of stdin as UTF-8, its trailing newlines dropped (as `--prompt "$(cat prompt.txt)"` drops them, so both
    ways give one prompt the same answer); empty is an error, not a prompt of nothing."""
    buffer = getattr(stdin, "buffer", None)
    if buffer is not None:
        raw = _bounded(buffer.read(MAX_STDIN_BYTES + 1))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LinesideError(f"the prompt on stdin is not valid UTF-8 (byte {e.start + 1} is 0x{raw[e.start]:02x}); "
                                "convert it first (e.g. iconv -f latin1 -t utf-8)") from None
    else:  # a text stream without bytes under it (tests, embedding): already decoded
        text = _bounded(stdin.read(MAX_STDIN_BYTES + 1))
    text = text.rstrip("\r\n")
    if not text.strip():
        raise LinesideError(f"the prompt on stdin is empty; {HOW}")
    return text


def _bounded(data: bytes | str) -> bytes | str:
    """``data`` when it is at most MAX_STDIN_BYTES long; one line otherwise (it was read one unit past the limit)."""
    if len(data) > MAX_STDIN_BYTES:
        raise LinesideError(f"the prompt on stdin is over {MAX_STDIN_BYTES >> 20} MiB, more than any bundle's context "
                            "holds; give a shorter one (e.g. head -c 100000 FILE | lineside generate BUNDLE -)")
    return data
