"""Where `lineside chat` and `lineside generate --chat` take their system prompt from: --system TEXT, or a file with
--system-file PATH (a long prompt that a command line quotes badly; llama.cpp's --system-prompt-file, Ollama's
SYSTEM in a Modelfile)."""

from __future__ import annotations

import codecs
from pathlib import Path

from lineside.errors import ArgumentsError, LinesideError
from lineside.runtime.invisible import strip_invisible
from lineside.runtime.prompt_input import MAX_STDIN_BYTES

OPTION = "--system-file"


def system_text(system: str | None, system_file: Path | None) -> str | None:
    """The system prompt from --system or --system-file (one of them; both is a usage error, exit 2), with its
    invisible characters stripped as a typed prompt's are; None when neither is given."""
    if system is not None and system_file is not None:
        raise ArgumentsError("the system prompt is given twice (--system and --system-file); give one of them")
    if system_file is not None:
        return strip_invisible(read_system_file(system_file))
    if system is None:
        return None
    from lineside import cli_checks as checks

    return strip_invisible(checks.utf8_text(system, "--system"))


def read_system_file(path: Path) -> str:
    """The file's text as UTF-8 (a leading BOM dropped, as editors on Windows write one; trailing newlines dropped,
    as generate drops a prompt file's), at most the 32 MiB generate reads of stdin; one line for a file that is
    missing, a directory, unreadable, larger, not UTF-8 or empty. A pipe (`--system-file <(...)`) is a file too."""
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_STDIN_BYTES + 1)
    except FileNotFoundError:
        raise LinesideError(f"{OPTION} {p}: no such file; check the path") from None
    except IsADirectoryError:
        raise LinesideError(f"{OPTION} {p} is a directory; give the file that holds the system prompt") from None
    except PermissionError:
        raise LinesideError(f"{OPTION} {p}: permission denied; make it readable or copy it somewhere you can "
                            "read") from None
    except OSError as e:
        raise LinesideError(f"{OPTION} {p}: cannot read it ({e.strerror or e}); check the path") from None
    if len(raw) > MAX_STDIN_BYTES:
        raise LinesideError(f"{OPTION} {p} is over {MAX_STDIN_BYTES >> 20} MiB, more than any bundle's context "
                            "holds; give a shorter system prompt")
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        start = bom + e.start
        raise LinesideError(f"{OPTION} {p} is not valid UTF-8 (byte {start + 1} is 0x{raw[start]:02x}); convert "
                            "it first (e.g. iconv -f latin1 -t utf-8)") from None
    text = text.rstrip("\r\n")
    if not text.strip():
        raise LinesideError(f"{OPTION} {p} is empty; write the system prompt in it, or leave {OPTION} out")
    return text
