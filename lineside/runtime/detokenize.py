"""Incremental detokenization that never emits broken UTF-8.

Byte-level BPE splits one character (Chinese, emoji) across tokens; decoding a partial
sequence yields U+FFFD. Text is released only once it no longer ends in a replacement
character, decoding from a short window so each step stays O(1).

The window starts in the prompt's last tokens, as vLLM's detokenizer does: a SentencePiece decoder drops the space
in front of the first token it decodes ("▁Paris" alone is "Paris"), and a completion's first token is not the
first of the text (the prompt goes on with " Paris"); and a prompt given as token ids may end inside a character
whose remaining bytes the first generated tokens carry.

``keep``: special tokens whose text stays in the output while the others are skipped (the markers a tool-call
parser reads, Mistral's ``[TOOL_CALLS]``), as vLLM keeps special tokens for its Mistral parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6  # prompt tokens decoded in front of the first generated ones (vLLM's slow path takes 5)
_LOOK_BACK = 16  # further prompt tokens searched for a character's start


class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...


class _KeepingDecoder:
    """Decodes with special tokens skipped except those in ``keep``, written as their own text: the runs between
    kept tokens are decoded apart (a kept marker ends a character and a word anyway)."""

    def __init__(self, tok: _Decodes, keep: frozenset[int]):
        self.tok, self.keep = tok, keep

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if not skip_special or not self.keep.intersection(ids):
            return self.tok.decode(ids, skip_special)
        out, run = [], []
        for i in ids:
            if i in self.keep:
                out += [self.tok.decode(run, True) if run else "", self.tok.decode([i], False)]
                run = []
            else:
                run.append(i)
        out.append(self.tok.decode(run, True) if run else "")
        return "".join(out)


def _prompt_tail(tok: _Decodes, prompt: list[int], skip_special: bool) -> list[int]:
    """The prompt's last few tokens, from the first byte of a character: a window that starts inside one decodes to
    U+FFFD there (with byte fallback, every byte of the run it starts in does). Empty when no such start is near.
    A start is tried also without the prompt's last 1-3 tokens: with byte fallback, a character the prompt leaves
    incomplete turns the whole run it ends into U+FFFD, its start included."""
    for start in range(len(prompt) - _PROMPT_CONTEXT, len(prompt) - _PROMPT_CONTEXT - _LOOK_BACK, -1):
        if start <= 0:
            return prompt
        if not tok.decode(prompt[start:], skip_special).startswith(_REPLACEMENT):
            return prompt[start:]
    for start in range(len(prompt) - _PROMPT_CONTEXT, len(prompt) - _PROMPT_CONTEXT - _LOOK_BACK, -1):
        for end in range(len(prompt) - 1, len(prompt) - 4, -1):
            text = tok.decode(prompt[start:end], skip_special)
            if text and not text.startswith(_REPLACEMENT):
                return prompt[start:]
    return []


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back only text that is complete (``prompt_ids``: what they follow)."""

    def __init__(self, tokenizer: _Decodes, skip_special: bool = True, prompt_ids: Sequence[int] = (),
                 keep: frozenset[int] = frozenset()):
        self.tok: _Decodes = _KeepingDecoder(tokenizer, keep) if keep and skip_special else tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = _prompt_tail(self.tok, [int(i) for i in prompt_ids], skip_special)
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(self.ids)  # ids up to here have been emitted (or are the prompt's)
        self._done_at: tuple[tuple[int, int], str, str] = ((-1, -1), "", "")  # _done's answer, by window

    def _done(self) -> tuple[str, str]:
        """(the window's text already out, as decoded; the text before the character the prompt may leave incomplete,
        which the tokens completing it release). That text is the window decoded without its last tokens (at most 3:
        a character's bytes but its last), not the decode cut before its U+FFFD: a byte-fallback decoder turns a run
        of byte tokens that is not UTF-8 as a whole into U+FFFD throughout, the whole characters before it included."""
        key = (self.prefix_offset, self.read_offset)
        if self._done_at[0] != key:
            window = self.ids[self.prefix_offset:self.read_offset]
            done = prefix = self.tok.decode(window, self.skip_special)
            if done.endswith(_REPLACEMENT):
                prefix = done.rstrip(_REPLACEMENT)
                for k in range(len(window) - 1, max(len(window) - 4, 0) - 1, -1):
                    text = self.tok.decode(window[:k], self.skip_special)
                    if not text.endswith(_REPLACEMENT):
                        prefix = text if len(text) > len(prefix) else prefix
                        break
            self._done_at = (key, done, prefix)
        return self._done_at[1], self._done_at[2]

    def _out(self, done: str, prefix: str, full: str) -> int:
        """Where the new text starts in ``full``: after the prompt's U+FFFD that the new tokens left as they were (a
        real U+FFFD of the prompt, a stray byte), so only those that became a character are text of the completion."""
        at = len(prefix)
        while at < len(done) and at < len(full) and full[at] == done[at]:
            at += 1
        return at

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        done, prefix = self._done()
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        at = self._out(done, prefix, full)
        if len(full) > at and not full.endswith(_REPLACEMENT):
            new = full[at:]
            if prefix == done:  # the next window starts where the text is whole, never inside a character
                self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end is dropped)."""
        done, prefix = self._done()
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[self._out(done, prefix, full):].rstrip(_REPLACEMENT)
