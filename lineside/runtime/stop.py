"""Stop strings matched on the decoded text, across token boundaries.

Text that could still be the start of a stop string is held back until the next token decides
it; once a stop string appears, everything from it on is dropped (OpenAI semantics), or, with vLLM's
``include_stop_str_in_output``, everything after it (the stop string ends the text). Under that flag nothing is
held back: text that may begin a stop string is in the answer whatever follows, so it goes out at once (as vLLM's
detokenizer sends it) and is kept only as the look-back a stop string spanning tokens is matched in.

Generation stops as soon as a stop string is complete, so where one token's text completes several, the one that
ends first wins (of those ending together, the one that starts first): the cut is the one the text fed a character
at a time gives, however the tokens split it.

Text fed unarmed (vLLM's ``min_tokens``: the first min_tokens tokens' text) cannot end a stop string: only a
stop string that ends in armed text stops, though it may begin in the unarmed text before it (as vLLM's
detokenizer checks only the text after min_tokens, looking back a stop string's length).
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_suffix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``: text to hold back
    while a stop string or a markup tag (``<tool_call>``, ``</think>``) may still be arriving."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class StopMatcher:
    """Feed complete text pieces; get back the part that is safe to emit and whether a stop string hit."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include  # vLLM's include_stop_str_in_output: the text is cut after the stop string, not before
        self.held = ""  # the text a stop string may have begun in: held back, or under ``include`` already sent
        self.unarmed = 0  # how many of ``held``'s first characters were fed unarmed
        self.stopped = False
        self.hit: str | None = None  # the stop string that ended the text (vLLM's stop_reason)

    def feed(self, text: str, armed: bool = True) -> str:
        """Text safe to emit now; sets ``stopped`` when a stop string completed (the rest is discarded).
        ``armed`` False: no stop string may end in ``text``."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        floor = len(buf) if not armed else self.unarmed  # a hit must end past this many characters
        found = ((buf.find(s, max(0, floor - len(s) + 1)), s) for s in self.stops)
        hits = [(i + len(s), i, s) for i, s in found if i >= 0]
        if hits:
            end, start, self.hit = min(hits)  # the first to end; of those, the first to start
            self.stopped = True
            sent = len(self.held) if self.include else 0  # a hit ends past the look-back (it was checked before)
            self.held, self.unarmed = "", 0
            return buf[sent:end] if self.include else buf[:start]
        keep = partial_suffix(buf, self.stops)
        self.held = buf[len(buf) - keep:] if keep else ""
        self.unarmed = max(0, floor - (len(buf) - keep))
        return text if self.include else buf[:len(buf) - keep]

    @property
    def waiting(self) -> int:
        """Characters fed but not yet returned (held back as a possible stop string's start): a later ``feed`` or
        ``flush`` returns them first. Under ``include`` the look-back already went out, so none wait."""
        return 0 if self.include or self.stopped else len(self.held)

    def flush(self) -> str:
        """At the end of generation (no stop hit): the held-back text is output after all (under ``include`` it
        went out as it came)."""
        out, self.held, self.unarmed = ("" if self.stopped or self.include else self.held), "", 0
        return out
