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
        raw = buffer.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LinesideError(f"the prompt on stdin is not valid UTF-8 (byte {e.start + 1} is 0x{raw[e.start]:02x}); "
                                "convert it first (e.g. iconv -f latin1 -t utf-8)") from None
    else:  # a text stream without bytes under it (tests, embedding): already decoded
        text = stdin.read()
    text = text.rstrip("\r\n")
    if not text.strip():
        raise LinesideError(f"the prompt on stdin is empty; {HOW}")
    return text
