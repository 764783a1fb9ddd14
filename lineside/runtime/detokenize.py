"""Incremental detokenization that never emits broken UTF-8.

Byte-level BPE splits one character (Chinese, emoji) across tokens; decoding a partial
sequence yields U+FFFD. Text is released only once it no longer ends in a replacement
character, decoding from a short window so each step stays O(1).
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back only text that is complete."""

    def __init__(self, tokenizer: _Decodes, skip_special: bool = True):
        self.tok = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # ids up to here have been emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end is dropped)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):].rstrip(_REPLACEMENT)
