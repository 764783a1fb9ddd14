"""How a build shows its progress: animated bars on a terminal, a few plain lines in a log, nothing with --quiet.

Bars redraw in place with cursor codes; in a CI log or a file (FORCE_COLOR set makes rich treat either as a
terminal) each redraw is kept, so a build's log filled with escape codes and carriage returns.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from lineside.console_line import say

Advance = Callable[[int], None]
ProgressFactory = Callable[[str, int], Advance]
LINE_MARKS = (0.25, 0.5, 0.75)  # fractions of a stage a log line is written at (and at its end)
LOG_AFTER_S = 10.0  # a stage writes log lines only once it has run this long


class ProgressMode(enum.Enum):
    BARS = "bars"  # an interactive terminal: rich bars, redrawn in place
    LINES = "lines"  # a log, a pipe, CI: plain lines for a stage that lasts (line_progress)
    NONE = "none"  # --quiet


def progress_mode(quiet: bool, console: Console, stream: TextIO) -> ProgressMode:
    """Bars only where someone watches a terminal that redraws: ``stream`` is a TTY (or TTY_INTERACTIVE=1 says
    to treat it as one) and rich finds it interactive (not TERM=dumb, not TTY_INTERACTIVE=0). FORCE_COLOR asks
    for colour, not for animation, so it does not turn a log into a terminal here."""
    if quiet:
        return ProgressMode.NONE
    try:
        tty = stream.isatty()
    except (ValueError, AttributeError):  # closed, or no isatty
        tty = False
    if console.is_interactive and (tty or os.environ.get("TTY_INTERACTIVE") == "1"):
        return ProgressMode.BARS
    return ProgressMode.LINES


def line_progress(log: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> ProgressFactory:
    """A progress factory that writes plain lines for stages that last: nothing for a stage's first
    ``LOG_AFTER_S``, then ``desc: n/N`` at once and at each quarter after, and ``desc: N/N done in S s`` at its end
    (at most five lines a stage, however long, and no control characters). A short build (or one that fails early)
    writes none, so its one error line stays the whole of stderr; a long one shows a log it is alive."""

    def factory(desc: str, total: int) -> Advance:
        done, start, spoke = 0, clock(), False
        marks = sorted({int(total * f) for f in LINE_MARKS} - {0, total})

        def advance(n: int) -> None:
            nonlocal done, spoke
            before, done = done, min(done + n, total)
            if done == before:
                return
            elapsed = clock() - start
            if done >= total:
                if spoke or elapsed >= LOG_AFTER_S:
                    log(f"{desc}: {total}/{total} done in {elapsed:.1f}s")
            elif elapsed >= LOG_AFTER_S and (not spoke or any(before < m <= done for m in marks)):
                log(f"{desc}: {done}/{total}")
                spoke = True

        return advance

    return factory


@contextmanager
def build_progress(mode: ProgressMode, console: Console) -> Iterator[ProgressFactory]:
    """Yield the progress factory for ``mode``, writing to ``console``."""
    if mode is ProgressMode.NONE:
        yield lambda _d, _t: (lambda _n: None)
        return
    if mode is ProgressMode.LINES:
        yield line_progress(lambda m: say(console, m))
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as prog:
        def factory(desc: str, total: int) -> Advance:
            task = prog.add_task(desc, total=total)
            return lambda n: prog.advance(task, n)

        yield factory
