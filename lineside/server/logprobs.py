"""Logprobs in OpenAI's shapes: chat ``logprobs.content`` (token, logprob, bytes, top_logprobs) and the legacy
completions block (tokens, token_logprobs, top_logprobs, text_offset); the request checks that go with them.

The numbers are the sampler's (``runtime.sampling``): log-softmax of the logits after penalties and any
grammar mask, before temperature, top-k/p and min-p.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

from lineside.runtime.sampling import MAX_TOP_LOGPROBS, TokenLogprob
from lineside.server.errors import APIError
from lineside.server.prompt_logprobs import prompt_logprobs_json

MAX_COMPLETION_LOGPROBS = MAX_TOP_LOGPROBS  # vLLM's bound (its max_logprobs, 20); OpenAI's own API stops at 5


def chat_top_n(logprobs: Any, top_logprobs: Any) -> int | None:
    """How many alternatives a chat request wants per token (None: no logprobs); 400 naming the field."""
    if logprobs is not None and not isinstance(logprobs, bool):  # 1 == True: a test by value let integers in
        raise APIError(400, "logprobs: must be true or false (top_logprobs says how many alternatives)",
                       "invalid_value", param="logprobs")
    if top_logprobs is not None:
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs: must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top_logprobs!r}",
                           "invalid_value", param="top_logprobs")
        if top_logprobs and not logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", "invalid_value", param="top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def completion_top_n(logprobs: Any) -> int | None:
    """/v1/completions ``logprobs`` (an integer 0..20, as vLLM takes it: alternatives per token, besides the chosen one)."""
    if logprobs is None or logprobs is False:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise APIError(400, f"logprobs: must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} on completions, "
                       f"got {logprobs!r}", "invalid_value", param="logprobs")
    return logprobs


def token_text(b: bytes) -> str:
    """The token's text; a token that is part of a UTF-8 character is written ``bytes:\\xNN...`` as OpenAI does."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


class TextOffsets:
    """Completions' ``text_offset``: where each token starts in the choice's text, in characters. A token's
    display string (``bytes:\\xNN``) is not its text, and a character's bytes may span tokens (and stream
    events), so the count follows the bytes through an incremental UTF-8 decoder, as the text itself is decoded."""

    def __init__(self, start: int = 0):
        self._chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, token: bytes) -> int:
        """The offset where ``token`` starts; then count the characters it completes."""
        at = self._chars
        self._chars += len(self._decoder.decode(token))
        return at


class LogprobFormatter:
    """Turns the sampler's ``TokenLogprob``s into response JSON; ``token_bytes`` maps an id to its raw bytes;
    ``skipped``: whether a token is left out of the text (a special token, skipped when decoding); ``decode``: one
    token id's text, special tokens kept (vLLM's ``decoded_token`` in prompt_logprobs)."""

    def __init__(self, token_bytes: Callable[[int], bytes], skipped: Callable[[int], bool] = lambda _: False,
                 decode: Callable[[int], str] | None = None):
        self._bytes = token_bytes
        self._skipped = skipped
        self._decode = decode or (lambda tid: token_text(token_bytes(tid)))

    def prompt(self, lps: Sequence[TokenLogprob], top_n: int) -> list[Any]:
        """vLLM's ``prompt_logprobs`` list of a prompt whose tokens 1 on ``lps`` score."""
        return prompt_logprobs_json(lps, top_n, self._decode)

    def _one(self, tid: int, lp: float) -> dict[str, Any]:
        b = self._bytes(tid)
        return {"token": token_text(b), "logprob": lp, "bytes": list(b)}

    def chat(self, lps: Sequence[TokenLogprob], top_n: int) -> list[dict[str, Any]]:
        """Entries for ``choices[].logprobs.content`` (also the streamed chunks')."""
        out = []
        for t in lps:
            e = self._one(t.token, t.logprob)
            e["top_logprobs"] = [self._one(i, v) for i, v in t.top[:top_n]]
            out.append(e)
        return out

    def completion(self, lps: Sequence[TokenLogprob], top_n: int, offset: int | TextOffsets = 0) -> dict[str, Any]:
        """The completions block (each top_logprobs dict also holds the sampled token, as OpenAI's: up to top_n + 1);
        ``offset``: characters of this choice's text before these tokens, or the choice's
        running ``TextOffsets`` (streamed: it carries a character split between events)."""
        where = offset if isinstance(offset, TextOffsets) else TextOffsets(offset)
        tokens, values, tops, offsets = [], [], [], []
        for t in lps:
            raw = self._bytes(t.token)
            tokens.append(token_text(raw))
            values.append(t.logprob)
            top: dict[str, float] = {}
            for i, v in t.top[:top_n]:
                top.setdefault(token_text(self._bytes(i)), v)
            top.setdefault(tokens[-1], t.logprob)  # OpenAI's "up to logprobs+1": the sampled token is always there
            tops.append(top)
            offsets.append(where.advance(b"" if self._skipped(t.token) else raw))  # no text: the next starts here
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def echoed_prompt(self, first: int, lps: Sequence[TokenLogprob], top_n: int) -> dict[str, Any]:
        """The completions block of an echoed prompt: its ``first`` token has no logprob (nothing comes before it:
        null in token_logprobs and top_logprobs, as OpenAI's legacy completions and vLLM write it), ``lps`` score
        the rest; text_offset counts from the start of the prompt."""
        where = TextOffsets()
        raw = self._bytes(first)
        head = {"tokens": [token_text(raw)], "token_logprobs": [None], "top_logprobs": [None],
                "text_offset": [where.advance(b"" if self._skipped(first) else raw)]}
        return joined(head, self.completion(lps, top_n, where))


def joined(*blocks: dict[str, Any]) -> dict[str, Any]:
    """Completions logprobs blocks one after the other (an echoed prompt's, then its completion's)."""
    return {key: [v for b in blocks for v in b[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                  "text_offset")}
