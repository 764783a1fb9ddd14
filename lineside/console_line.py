"""One message, one line: what the commands print beside their tables goes through ``say``."""

from __future__ import annotations

from rich.console import Console


def say(console: Console, text: str, style: str | None = None) -> None:
    """Print ``text`` as it is, on one line whatever the width: rich wraps at 80 columns when the output is
    not a terminal (a log file, CI, a pipe), which would cut a one-line note or a path in two; and text is
    not markup, so a `[...]` in a path or a message stays."""
    console.print(text, style=style, soft_wrap=True, markup=False, highlight=False)
